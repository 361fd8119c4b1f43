"""The GPU kernels, in Triton: paged KV store, decode and prefill attention, norms, RoPE, activations,
fused MoE, LoRA's segmented GEMMs and the packed-weight GEMMs; each a shape-checking wrapper and a
`@triton.jit` body, with its torch reference in kernels/ (reference.py and the *_reference.py
files). `launch.py` plans launches; `aot_launches.py` lists them for kernels/aot.py."""

import os as _os

if _os.environ.get("TRITON_INTERPRET") == "1":   # the CPU interpreter: skip the checks it discards
    from kernels.gpu.interpreter import skip_discarded_overflow_checks as _skip

    _skip()
