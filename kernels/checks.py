"""Helpers shared by the kernel wrappers: argument checks, output allocation, device facts.

Nothing here launches a kernel. The wrappers call `alloc` through this module (not a copy of the
name) so the tests can swap it for a NaN-filling version and catch elements a kernel never writes.
"""
from __future__ import annotations

import functools
import math
import os
import weakref
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,)
# what the KV cache may hold: the float dtypes, or e4m3 (kv_cache_dtype=fp8, GPUs of sm_89+)
KV_CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


def alloc(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (or scratch buffer); every element is written by a kernel."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device, and a device the Triton kernels can run on."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"{name}: all tensors must be on one device; got {device} and {t.device}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name}: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set "
                         f"before triton is imported to run them on the CPU; got device {device}")


def check_dtype(name: str, arg: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name}: {arg} must have dtype in ({names}); got {str(t.dtype).replace('torch.', '')}")


def check_ndim(name: str, arg: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: {arg} must be {ndim}-D {layout}; got shape {tuple(t.shape)}")


def check_cache(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_ndim(name, "k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{name}: v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    check_dtype(name, "k_cache", k_cache, KV_CACHE_DTYPES)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device. On the CPU (the interpreter runs programs one at a
    time, so parallelism is moot) a small stand-in keeps the same heuristics meaningful."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def check_paged_attention(name: str, q: torch.Tensor, q_layout: str, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float, cache_dtype_may_differ: bool = False, window: int = 0) -> None:
    """The checks decode and prefill attention share: q against the paged cache (dtype unless
    ``cache_dtype_may_differ`` or an fp8 cache, head dim, GQA ratio), index tensors, the scale and
    the sliding window (0: none; else each query sees its last ``window`` positions, itself included)."""
    check_ndim(name, "q", q, 3, q_layout)
    check_cache(name, k_cache, v_cache)
    check_ndim(name, "block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    check_dtype(name, "q", q, FLOAT_DTYPES)
    check_dtype(name, "block_tables", block_tables, INDEX_DTYPES)
    check_dtype(name, "seq_lens", seq_lens, INDEX_DTYPES)
    h, d = q.shape[1], q.shape[2]
    g, cd = k_cache.shape[2], k_cache.shape[3]
    if q.dtype != k_cache.dtype and not cache_dtype_may_differ and k_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"{name}: q dtype {q.dtype} != cache dtype {k_cache.dtype}")  # fp8: read in q's
    if cd != d:
        raise ValueError(f"{name}: q head_dim {d} != cache head_dim {cd}")
    if h % g != 0:
        raise ValueError(f"{name}: num_heads {h} must be a multiple of num_kv_heads {g}")
    if not math.isfinite(scale):
        raise ValueError(f"{name}: scale must be finite; got {scale}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{name}: window must be an integer >= 0 (0: no sliding window); got {window!r}")


class _BoundsChecked:
    """Index tensors whose bounds were checked: the same tensor, unchanged, is not read again (the
    engine passes one step's positions, slots, tables and lengths to every layer). Inference
    tensors (the engine's) keep no version counter; for them the same object counts as unchanged,
    which holds for the engine's per-step tensors, built once and only read."""

    def __init__(self):
        self._seen: dict[str, tuple[weakref.ref, Optional[int], int]] = {}

    def once(self, key: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
        version = None if t.is_inference() else t._version
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is t and seen[1] == version and seen[2] == high:
            return
        if t.numel() and (int(t.min()) < low or int(t.max()) >= high):
            raise ValueError(f"{what} must lie in [{low}, {high}); got [{int(t.min())}, {int(t.max())}]")
        self._seen[key] = (weakref.ref(t), version, high)


bounds_checked = _BoundsChecked()
