"""worker: the only layer that touches a device.

Owns the model runner (`runner.py`: weights, KV tensors, one step's plan run), the persistent batch
of the sequences it was told of (`input_batch.py`: their tokens, sampling settings, seeded streams
and block tables) and each step's flat inputs and attention metadata (`step_inputs.py`,
`attention_metadata.py`), sampling (`sample_step.py`, `sampler.py`, and the rejection sampler of
speculative decoding, `rejection.py`), the decode fast path chosen in one place (`fast_paths.py`:
CUDA graphs, `cuda_graphs.py`, or the CPU's C decode stack, `native_decode.py`), the device and its
memory (`device.py`, `memory.py`), the warm-up (`warmup.py`), the KV tiers' copies (`kv_copier.py`),
LoRA on the device (`lora/`), pooling sequences' hidden states (`pooler.py`), CPU thread placement (`cpu_affinity.py`, `cpu_memory.py`), and the
tensor-parallel runtime (`parallel/`: the group, its shared-memory collectives, the step message).

May import core, kv, sched's data and models; never the engine.
"""
