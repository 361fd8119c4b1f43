"""worker: the only layer that touches a device.

Owns the model runner (`runner.py`: weights, KV tensors, one step's model run), the persistent
input batch and each step's flat inputs (`input_batch.py`, `step_inputs.py`), sampling and the
rejection sampler of speculative decoding (`sampler.py`, `rejection.py`), the decode fast paths
(`fast_paths.py` chooses between CUDA graphs, `cuda_graphs.py`, and the CPU's C decode stack,
`native_decode.py`), the device (`device.py`), the warm-up (`warmup.py`), the KV tiers' copies
(`kv_copier.py`), LoRA slots on the device (`lora_manager.py`, `lora_segments.py`), CPU thread
placement (`cpu_affinity.py`, `cpu_memory.py`), and the tensor-parallel runtime (`parallel/`).

May import core, kv, sched's step planning data and models; never the engine.
"""
