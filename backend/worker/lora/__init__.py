"""LoRA on the device (docs/lora.md): the loaded adapters and their resident slots, run-time load and
unload (`manager.py`), the stacked device tensors of the resident adapters (`bank.py`), a step's rows
grouped by adapter (`segments.py`), the per-step object whose `add` every layer calls
(`step.py`, with the batched CPU path `cpu_sgmv.py`), and an adapter's shard on a tensor-parallel
rank (`tensor_parallel.py`).
"""
