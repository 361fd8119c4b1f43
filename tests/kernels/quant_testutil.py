"""Helpers for the quantized GEMM tests: packed GGUF matrices made the importer's way, and the
error bound a quantized GEMM must meet against kernels/quant_formats.py `linear_reference`."""
from __future__ import annotations

import torch

from backend.gguf_packed import BLOCK_SIZES, TYPE_IDS, pack
from kernel_testutil import DEVICE
from kernels.quant_formats import dequantize
from test_quant_layout import random_blocks

# Per-weight rounding of the dequantized value to x's dtype (unit roundoff u), the output's rounding
# (another u of |out| <= sum |x w|), and float32 accumulation: the kernel's error is at most about
# 2u * sum_k |x_k w_k| per output. A float32 run has only accumulation-order error.
BOUND = {torch.float32: 1e-6, torch.float16: 2 * 2.0 ** -11, torch.bfloat16: 2 * 2.0 ** -8}


def gguf_matrix(qtype: str, n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """A random [N, K] matrix of ggml blocks (any bytes, small finite scales) split into the packed
    arrays by the importer's own function (backend/gguf_packed.py)."""
    per_block, _ = BLOCK_SIZES[TYPE_IDS[qtype]]
    raw = random_blocks(qtype, n, k // per_block, seed)
    return {a: torch.from_numpy(v).to(DEVICE) for a, v in pack(raw, TYPE_IDS[qtype], (n, k)).items()}


def assert_quant_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, qtype: str,
                       parts: dict, what: str = "") -> None:
    """got within BOUND[dtype] * (|x| @ |W|.T) of want, elementwise; no NaN (unwritten) entries."""
    assert got.shape == want.shape and got.dtype == want.dtype == x.dtype, (got.shape, got.dtype, want.shape)
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (an element was never written?)"
    w = dequantize(qtype, {a: t.cpu() for a, t in parts.items()})
    scale = x.float().cpu().abs() @ w.abs().T
    err = (got.float().cpu() - want.float().cpu()).abs()
    limit = BOUND[x.dtype] * scale + 1e-30
    worst = (err / limit).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3g} is {worst:.2f}x the bound"
