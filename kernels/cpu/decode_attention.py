"""Decode attention on the CPU over the paged cache in place (kernels/cpu/csrc/decode_attention.c).

Same signature and result as `reference.decode_attention`, which is its oracle in the tests. The
reference gathers every sequence's blocks into a padded copy per layer and step, then runs a
batched matmul on it: at batch 64 with 250-token contexts that copy is ~25 MB per layer and the
attention took a third of the step (docs/performance.md). This kernel reads each K/V row once,
where it lies, and computes only each sequence's own tokens.

float32 queries (the CPU engine's activations) over float32 or bfloat16 caches
(kv_cache_dtype=bfloat16: each element widened as it is read).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from kernels import checks as _common

from kernels.cpu import build as cpu_build
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURE = (_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I)
NAME = "decode_attention"
CACHE_DTYPES = (torch.float32, torch.bfloat16)
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # each cache dtype's copy of the kernel


def check_args(q, k_cache, v_cache, block_tables, seq_lens, scale, window: int = 0) -> None:
    """Every shape, dtype and bound the C code relies on; it checks nothing itself. The checks it
    shares with the Triton kernels (q against the paged cache, the GQA ratio, the scale) are
    `_common.check_paged_attention`; the rest are this kernel's own: float32, CPU, contiguous,
    int32 indices, and the bounds, read once per step."""
    _common.check_paged_attention(NAME, q, "[num_seqs, num_heads, head_dim]", k_cache, v_cache,
                                  block_tables, seq_lens, scale, cache_dtype_may_differ=True, window=window)
    s = q.shape[0]
    nb, bs = k_cache.shape[:2]
    for name, t, dtypes in (("q", q, (torch.float32,)), ("k_cache", k_cache, CACHE_DTYPES),
                            ("v_cache", v_cache, CACHE_DTYPES)):
        if t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{NAME}: {name} must be a contiguous CPU tensor of "
                             f"{' or '.join(str(d) for d in dtypes)}; got {t.dtype} on {t.device}")
    if block_tables.dtype != torch.int32 or block_tables.shape[0] != s:
        raise ValueError(f"{NAME}: block_tables must be int32 [{s}, MB]; got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (s,):
        raise ValueError(f"{NAME}: seq_lens must be int32 [{s}]; got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    # Every layer of a step passes the same tables and lengths: their bounds are read once.
    _common.bounds_checked.once("seq_lens", seq_lens, 0, block_tables.shape[1] * bs + 1,
                                f"{NAME}: seq_lens (the table holds {block_tables.shape[1]} blocks of {bs})")
    _common.bounds_checked.once("block_tables", block_tables, 0, nb, f"{NAME}: block ids")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                     max_seq_len: Optional[int] = None, window: int = 0) -> torch.Tensor:
    """q [S, H, D]; seq_lens [S] cached tokens per sequence (the query's own included) -> [S, H, D];
    window > 0: each query reads only its last `window` tokens (a sliding-window layer)."""
    q = q.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    check_args(q, k_cache, v_cache, block_tables, seq_lens, scale, window)
    out = _common.alloc(q.shape, q.dtype, q.device)  # through the module: tests poison it
    s, h, d = q.shape
    _, bs, g, _ = k_cache.shape
    kernel = cpu_build.function(NAME, f"decode_attention_{SUFFIX[k_cache.dtype]}", _SIGNATURE)
    kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
           out.data_ptr(), s, h, g, d, bs, block_tables.shape[1], float(scale), window)
    return out
