"""The GPU kernels, in Triton: paged KV store, decode and prefill attention, norms, RoPE, activations,
fused MoE, LoRA's segmented GEMMs and the packed-weight GEMMs; each a shape-checking wrapper and a
`@triton.jit` body, with its torch reference in kernels/ (reference.py and the *_reference.py
files). `launch.py` plans launches; `aot_launches.py` lists them for kernels/aot.py."""
