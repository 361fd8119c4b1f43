"""Tensor parallelism's runtime: one engine on N ranks over torch.distributed (docs/parallelism.md).

`step_message.py` (a step as one message), `group.py` (the process group, its collectives, a lost
rank), `rendezvous.py` (forming the group), `launcher.py` (rank 0's worker processes), `worker.py`
(a rank other than 0), `vision.py` (images: rank 0's encoder, its rows sent to the ranks). How a
model is split is models/parallel/.
"""
