"""Helpers for the quantized GEMM tests: packed GGUF matrices made the importer's way, and the
error bound a quantized GEMM must meet against kernels/quant_formats.py `linear_reference`."""
from __future__ import annotations

import torch

from backend.models.gguf.packed import BLOCK_SIZES, TYPE_IDS, pack
from kernel_testutil import DEVICE
from kernels.gpu.quant_bench import compare
from test_quant_layout import random_blocks


def gguf_matrix(qtype: str, n: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """A random [N, K] matrix of ggml blocks (any bytes, small finite scales) split into the packed
    arrays by the importer's own function (backend/models/gguf/packed.py)."""
    per_block, _ = BLOCK_SIZES[TYPE_IDS[qtype]]
    raw = random_blocks(qtype, n, k // per_block, seed)
    return {a: torch.from_numpy(v).to(DEVICE) for a, v in pack(raw, TYPE_IDS[qtype], (n, k)).items()}


def assert_quant_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, qtype: str,
                       parts: dict, what: str = "") -> None:
    """got within kernels/gpu/quant_bench.py's `error_bound` of want (the GPU check's own criterion),
    elementwise, in x's dtype, with no NaN (unwritten) entries."""
    assert got.shape == want.shape and got.dtype == want.dtype == x.dtype, (got.shape, got.dtype, want.shape)
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (an element was never written?)"
    ok, err, ratio = compare(got, want, x, qtype, parts)
    assert ok, f"{what}: error {err:.3g} is {ratio:.2f}x the bound"
