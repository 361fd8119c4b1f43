"""The quantized weight formats the GPU kernels run besides GGUF's packed layout, in torch: their
dequantization (the kernels' oracles), the FP8 quantizer the loader uses (`quantization=fp8`), the
AWQ packing, and `linear_reference`, the product every quantized GEMM must reproduce.

| qtype | arrays | w[n, k] |
| --- | --- | --- |
| GGUF types (Q4_0 ... Q6_K, Q8_0) | docs/quantization.md | kernels/quant_reference.py `dequantize` |
| `INT8` | qweight int8 [N, K], scales float [N, K / G] | scales[n, k // G] * qweight[n, k] |
| `FP8` | qweight float8_e4m3fn [N, K], scales float32 [N, 1] | scales[n, 0] * qweight[n, k] |
| `AWQ` | qweight int32 [K, N / 8], qzeros int32 [K / G, N / 8], scales float16 [K / G, N] | (q - z) * scales (kernels/gpu/quant_awq_gemm.py) |

Everything is computed in float32.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from kernels import quant_reference

FP8_MAX = 448.0                 # the largest finite float8 e4m3fn value
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble j of an AWQ int32 holds output 8 c + AWQ_ORDER[j]
AWQ_SHIFTS = tuple(4 * AWQ_ORDER.index(i) for i in range(8))  # output 8 c + i sits at this shift
ARRAYS = {"INT8": ("qweight", "scales"), "FP8": ("qweight", "scales"), "AWQ": ("qweight", "qzeros", "scales")}


def logical_shape(qtype: str, parts: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(N, K) = (out_features, in_features) of any quantized matrix, from its `qweight`."""
    rows, cols = parts["qweight"].shape
    if qtype == "AWQ":
        return cols * 8, rows
    return rows, cols if qtype in ("Q8_0", "INT8", "FP8") else cols * 2


def dequantize_w8(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """INT8 / FP8: the float32 weights [N, K] = scales per group x codes."""
    q, scales = parts["qweight"], parts["scales"]
    group = q.shape[1] // scales.shape[1]
    return scales.float().repeat_interleave(group, dim=1) * q.float()


def quantize_fp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A float weight [N, K] -> FP8 arrays with one float32 scale per output channel: scale =
    max|w| / 448 over the row (1 for an all-zero row), codes = w / scale rounded to e4m3 (nearest
    even), in float32 whatever the weight's dtype. Runs where the weight is (on the GPU at load)."""
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"quantize_fp8: weight must be a 2-D float matrix; got {weight.dtype} {tuple(weight.shape)}")
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    if not torch.isfinite(amax).all():
        raise ValueError("quantize_fp8: the weight has inf or NaN values")
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / scales).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"qweight": codes, "scales": scales}


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [R, N] (0..15, N a multiple of 8) -> AWQ int32 [R, N / 8]."""
    r, n = codes.shape
    if n % 8:
        raise ValueError(f"pack_awq: the output dimension must be a multiple of 8; got {n}")
    c = codes.to(torch.int64).view(r, n // 8, 8)
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int64, device=codes.device)
    packed = ((c & 15) << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, N / 8] -> codes [R, N] int32 (0..15)."""
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed[..., None] >> shifts) & 15).reshape(packed.shape[0], -1)


def quantize_awq(weight: torch.Tensor, group: int = 128) -> dict[str, torch.Tensor]:
    """A float weight [N, K] -> AWQ arrays, asymmetric min-max per group of `group` inputs (AWQ's
    rounding without its activation-aware search; what tests and benchmarks need)."""
    n, k = weight.shape
    if k % group or n % 8:
        raise ValueError(f"quantize_awq: needs K a multiple of group {group} and N of 8; got [{n}, {k}]")
    w = weight.float().t().reshape(k // group, group, n)           # [K / G, G, N]
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    scales = ((hi - lo).clamp_min(1e-5) / 15).half()
    zeros = torch.round(-lo / scales.float()).clamp_(0, 15)
    q = (torch.round(w / scales.float()[:, None]) + zeros[:, None]).clamp_(0, 15)
    return {"qweight": pack_awq(q.reshape(k, n)), "qzeros": pack_awq(zeros), "scales": scales}


def dequantize_awq(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """AWQ: the float32 weights, transposed to [N, K] like every other format here."""
    q, z, scales = unpack_awq(parts["qweight"]), unpack_awq(parts["qzeros"]), parts["scales"]
    group = q.shape[0] // scales.shape[0]
    zeros = z.repeat_interleave(group, dim=0)
    return ((q - zeros).float() * scales.float().repeat_interleave(group, dim=0)).t()


def dequantize(qtype: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Any quantized matrix -> its float32 weights [N, K]."""
    if qtype in ("INT8", "FP8"):
        return dequantize_w8(parts)
    if qtype == "AWQ":
        return dequantize_awq(parts)
    return quant_reference.dequantize(qtype, parts)


def linear_reference(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor],
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) in float32 on the dequantized weights, rounded to x's dtype once:
    what every quantized GEMM computes, up to its rounding of the weights to x's dtype."""
    w = dequantize(qtype, parts).to(x.device)
    out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)
