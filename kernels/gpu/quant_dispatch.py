"""The one call the engine makes for a quantized linear layer on the GPU:

    quant_linear(x, qtype, parts, bias=None)    # x [..., K] -> [..., N], in x's dtype

`qtype` and `parts` are a packed matrix as the checkpoint folder holds it (docs/quantization.md:
a GGUF type and its arrays) or one of kernels/quant_formats.py's (`INT8`, `FP8`, `AWQ`). On CUDA
tensors (and on the CPU under TRITON_INTERPRET=1, as the tests run it) the family's Triton kernel
runs: GGUF 4/5/6-bit -> quant_gguf_gemm, 8-bit -> quant_w8_gemm, AWQ -> quant_awq_gemm. On the CPU
otherwise, the torch reference (backend/models/quant_linear.py has its own C kernels there).

`aot_launches` lists what the kernels launch for a model's projections, for kernels.aot.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

from kernels.quant_formats import linear_reference

GGUF_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
W8_QTYPES = ("Q8_0", "INT8", "FP8")
QTYPES = GGUF_QTYPES + W8_QTYPES + ("AWQ",)


def _kernel(qtype: str):
    """The family's `*_launches(x, parts, bias)`: checks, the output, the launches that write it."""
    if qtype in GGUF_QTYPES:
        from kernels.gpu.quant_gguf_gemm import gguf_launches
        return lambda x, parts, bias: gguf_launches(x, qtype, parts, bias)
    if qtype in W8_QTYPES:
        from kernels.gpu.quant_w8_gemm import w8_launches
        return lambda x, parts, bias: w8_launches(x, qtype, parts, bias)
    from kernels.gpu.quant_awq_gemm import awq_launches
    return awq_launches


def quant_launches(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor],
                   bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list]:
    """quant_linear's checks, for x [M, K]: the output [M, N] (unwritten) and the kernel launches
    that write it (to run later, e.g. timed without the Python checks: kernels/gpu/quant_bench.py)."""
    if qtype not in QTYPES:
        raise ValueError(f"quant_linear: no GPU kernel for {qtype!r}; supported: {', '.join(QTYPES)}")
    return _kernel(qtype)(x, parts, bias)


def quant_linear(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor],
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) -> [..., N] in x's dtype, W the quantized matrix `parts`."""
    if qtype not in QTYPES:
        raise ValueError(f"quant_linear: no GPU kernel for {qtype!r}; supported: {', '.join(QTYPES)}")
    if x.dim() < 1:
        raise ValueError("quant_linear: x must have a feature dimension")
    rows = x.reshape(-1, x.shape[-1])
    if x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        out, plans = quant_launches(rows, qtype, parts, bias)
        for launch in plans:
            launch()
    else:
        out = linear_reference(rows, qtype, parts, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


# -- ahead-of-time compilation ----------------------------------------------------------------------
AOT_ROWS = (16, 64, 512)      # one batch per tile regime: decode <= 16, decode <= 64, prefill
AOT_SMS = (108, 132)          # A100, H100/H200: the split-K choice depends on the SM count
_K_ALIGN = 256                # every qtype's rows are whole blocks of this at the models' sizes


def _weight(qtype: str, n: int, k: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Uninitialized arrays of the qtype's shapes and dtypes (nothing is read: only compiled)."""
    e = torch.empty
    if qtype == "AWQ":
        return {"qweight": e(k, n // 8, dtype=torch.int32), "qzeros": e(k // 128, n // 8, dtype=torch.int32),
                "scales": e(k // 128, n, dtype=torch.float16)}
    if qtype in W8_QTYPES:
        code = torch.float8_e4m3fn if qtype == "FP8" else torch.int8
        scales = e(n, k // 32, dtype=torch.float16) if qtype == "Q8_0" else e(n, 1, dtype=torch.float32)
        return {"qweight": e(n, k, dtype=code), "scales": scales}
    from kernels.quant_reference import ARRAYS
    shapes = {"qweight": (k // 2, torch.uint8), "qhigh": (k // (4 if qtype == "Q6_K" else 8), torch.uint8),
              "scales": (k // (256 if "K" in qtype[2:] else 32), torch.float16),
              "sub_scales": (k // (16 if qtype == "Q6_K" else 32), torch.int8 if qtype == "Q6_K" else torch.uint8),
              "sub_mins": (k // 32, torch.uint8)}
    shapes["mins"] = shapes["scales"]
    return {a: e(n, shapes[a][0], dtype=shapes[a][1]) for a in ARRAYS[qtype]}


def aot_launches(projections: Mapping[str, tuple[int, int, bool]], dtype: torch.dtype) -> list:
    """The launches of every quantized GEMM family for a model's projections ({name: (N, K, has
    bias)}), at each tile regime and each GPU's split-K choice, on CPU tensors of the real shapes.
    Each Launch carries the compute capability its kernel needs (FP8: 8.9)."""
    from dataclasses import replace

    from kernels.gpu import quant_tiles as T
    from kernels.gpu.quant_awq_gemm import plan_awq_linear
    from kernels.gpu.quant_gguf_gemm import plan_gguf_linear
    from kernels.gpu.quant_w8_gemm import FP8_MIN_ARCH, plan_w8_linear

    out = []
    for qtype in QTYPES:
        for n, k, has_bias in projections.values():
            if k % _K_ALIGN or n % 8:
                continue
            parts = _weight(qtype, n, k, dtype)
            bias = torch.empty(n, dtype=torch.float32) if has_bias else None
            for m in AOT_ROWS:
                x = torch.empty(m, k, dtype=dtype)
                for sms in AOT_SMS:
                    tiles = T.plan_tiles(m, n, k, x.device, sms=sms, k_group=128 if qtype == "AWQ" else None)
                    res, partials = T.outputs(x, n, tiles)
                    if qtype in GGUF_QTYPES:
                        plans = plan_gguf_linear(x, qtype, parts, bias, res, partials, tiles)
                    elif qtype in W8_QTYPES:
                        plans = plan_w8_linear(x, qtype, parts, bias, res, partials, tiles)
                    else:
                        plans = plan_awq_linear(x, parts, bias, res, partials, tiles)
                    if qtype == "FP8":
                        plans = [replace(p, min_arch=FP8_MIN_ARCH) for p in plans]
                    out += plans
    return out
