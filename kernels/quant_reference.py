"""Torch references for the quantized weights of docs/quantization.md: dequantization, and the
matmul every quantized kernel must reproduce.

`dequantize` is the layout's value table in torch, in ggml's float32 operation order, so its result
equals llama.cpp's dequantized weights to the bit (tests/test_quant_layout.py checks it against the
`gguf` package). It works on any subset of rows (the arrays are row-major, whole rows), which the
quantized embedding uses to look up a step's tokens.

`quantize_activations` and `qmatmul` are what the CPU kernels compute (kernels/cpu/quant.py): the
activations quantized per row in groups of 32 to int8 with a float scale, as llama.cpp quantizes
them (Q8_0/Q8_1), then integer dot products per group, scaled. Their result differs from
`x @ dequantize(w).T` by the activations' rounding, which the tests bound.
"""
from __future__ import annotations

from typing import Mapping

import torch

QK, QK_K = 32, 256
# type -> (bits of the codes, zero point subtracted before scaling (None: a `mins` term instead))
CODE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
# the arrays each type has (docs/quantization.md)
ARRAYS = {
    "Q8_0": ("qweight", "scales"), "Q4_0": ("qweight", "scales"), "Q4_1": ("qweight", "scales", "mins"),
    "Q5_0": ("qweight", "qhigh", "scales"), "Q5_1": ("qweight", "qhigh", "scales", "mins"),
    "Q4_K": ("qweight", "scales", "mins", "sub_scales", "sub_mins"),
    "Q5_K": ("qweight", "qhigh", "scales", "mins", "sub_scales", "sub_mins"),
    "Q6_K": ("qweight", "qhigh", "scales", "sub_scales"),
}


def _bits(planes: torch.Tensor, rows: int, groups: int, count: int) -> list[torch.Tensor]:
    """``qhigh`` [rows, groups * 4 * count] -> ``count`` tensors [rows, groups * 32] of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=planes.device)
    b = planes.view(rows, groups, count, 4, 1) >> shifts  # bit i of a plane: byte i // 8, bit i % 8
    b = (b & 1).view(rows, groups, count, QK)
    return [b[:, :, p].reshape(rows, groups * QK) for p in range(count)]


def codes(qtype: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The integer code of every value, [N, K] int32 (signed for Q8_0, else unsigned)."""
    qw = parts["qweight"]
    if qtype == "Q8_0":
        return qw.to(torch.int32)
    rows, groups = qw.shape[0], qw.shape[1] // (QK // 2)
    g = qw.view(rows, groups, QK // 2)
    q = torch.cat([g & 0x0F, g >> 4], dim=-1).reshape(rows, groups * QK).to(torch.int32)
    extra = CODE_BITS[qtype] - 4
    for p, plane in enumerate(_bits(parts["qhigh"], rows, groups, extra) if extra else []):
        q = q | (plane.to(torch.int32) << (4 + p))
    return q


def _per_value(t: torch.Tensor, width: int) -> torch.Tensor:
    """A per-group array [N, K / width] repeated to [N, K], float32."""
    return t.float().repeat_interleave(width, dim=1)


def dequantize(qtype: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weights [N, K] that a packed matrix stands for (docs/quantization.md, Values)."""
    if qtype not in CODE_BITS:
        raise ValueError(f"no packed type {qtype!r}; packed types: {', '.join(CODE_BITS)}")
    q = codes(qtype, parts).float()
    scales = parts["scales"]
    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _per_value(scales, QK)
        if qtype == "Q8_0":
            return d * q
        if qtype in ("Q4_0", "Q5_0"):
            return d * (q - (8.0 if qtype == "Q4_0" else 16.0))
        return d * q + _per_value(parts["mins"], QK)
    if qtype == "Q6_K":
        return (_per_value(scales, QK_K) * _per_value(parts["sub_scales"], 16)) * (q - 32.0)
    scale = _per_value(scales, QK_K) * _per_value(parts["sub_scales"], QK)
    return scale * q + _per_value(parts["mins"], QK_K) * _per_value(parts["sub_mins"], QK)


# -- what the CPU kernels compute -----------------------------------------------------------------
def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (codes int8 [M, K], scales float32 [M, K/32]): per group of 32,
    scale = max|x| / 127 and code = round(x / scale) (llama.cpp's quantize_row_q8_0)."""
    m, k = x.shape
    g = x.float().view(m, k // QK, QK)
    scale = g.abs().amax(dim=-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(m, k), scale


def qmatmul(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor],
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T with W packed, as the kernels compute it: activations quantized per group
    (`quantize_activations`), each group's product exact in integers, then scaled in float32."""
    qa, da = quantize_activations(x)
    xq = (qa.float() * da.repeat_interleave(QK, dim=1))  # the activations the kernels see
    out = xq.double() @ dequantize(qtype, parts).double().T
    out = out.float()
    return out if bias is None else out + bias.float()
