"""Decode attention on the CPU over the paged cache in place (kernels/csrc/decode_attention.c).

Same signature and result as `reference.decode_attention`, which is its oracle in the tests. The
reference gathers every sequence's blocks into a padded copy per layer and step, then runs a
batched matmul on it: at batch 64 with 250-token contexts that copy is ~25 MB per layer and the
attention took a third of the step (docs/performance.md). This kernel reads each K/V row once,
where it lies, and computes only each sequence's own tokens.

float32 caches only (the CPU engine's dtype); the dispatcher keeps the reference for the others.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from kernels import _common, cpu_build
from kernels.cpu_elementwise import checked

_P = ctypes.c_void_p
_I = ctypes.c_int64


def _kernel():
    lib = cpu_build.load("decode_attention")
    fn = lib.decode_attention_f32
    fn.restype = None
    fn.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float]
    return fn


def check_args(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    """Every shape, dtype and bound the C code relies on; it checks nothing itself."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"decode_attention: expected q [S, H, D] and k/v caches [NB, BS, G, D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    s, h, d = q.shape
    nb, bs, g, dk = k_cache.shape
    if dk != d or h % g:
        raise ValueError(f"decode_attention: head dim {d} vs cache {dk}, or {h} query heads not a "
                         f"multiple of {g} kv heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"decode_attention: {name} must be a contiguous float32 CPU tensor; "
                             f"got {t.dtype} on {t.device}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != s:
        raise ValueError(f"decode_attention: block_tables must be int32 [{s}, MB]; got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (s,):
        raise ValueError(f"decode_attention: seq_lens must be int32 [{s}]; got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    # Every layer of a step passes the same tables and lengths: their bounds are read once.
    checked.once("seq_lens", seq_lens, 0, block_tables.shape[1] * bs + 1,
                 f"decode_attention: seq_lens (the table holds {block_tables.shape[1]} blocks of {bs})")
    checked.once("block_tables", block_tables, 0, nb, "decode_attention: block ids")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                     max_seq_len: Optional[int] = None) -> torch.Tensor:
    """q [S, H, D]; seq_lens [S] cached tokens per sequence (the query's own included) -> [S, H, D]."""
    q = q.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    check_args(q, k_cache, v_cache, block_tables, seq_lens)
    out = _common.alloc(q.shape, q.dtype, q.device)  # through the module: tests poison it
    s, h, d = q.shape
    _, bs, g, _ = k_cache.shape
    _kernel()(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
              seq_lens.data_ptr(), out.data_ptr(), s, h, g, d, bs, block_tables.shape[1], float(scale))
    return out
