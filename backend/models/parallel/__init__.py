"""Tensor-parallel sharding of a model (docs/parallelism.md): `plan.py`, the split and its checks
(torch-free), each HF tensor cut as the loader reads it; `layers.py`, the model's row-parallel and
vocabulary-parallel seams. The process group and the step messages are the worker's
(worker/parallel/)."""
