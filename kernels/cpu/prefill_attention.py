"""Causal prefill attention on the CPU over the paged cache in place (kernels/cpu/csrc/prefill_attention.c).

Same signature and result as `reference.prefill_attention` (torch's SDPA on each chunk's gathered
context), its oracle in the tests, within float32 rounding: the C kernel sums in its own order
(key tiles of 64, online softmax). The CPU engine's prompt rows run it in both its paths, the C
layer stack's (kernels/cpu/decode_stack.py) and the Python layers' (kernels/dispatch.py cpu_ops),
so the two stay bit for bit alike. It reads each chunk's context out of its blocks where they lie
(no gathered copy per layer and sequence) and shares each K/V tile among the query heads of a
group.

float32 queries over float32 or bfloat16 caches. Over bfloat16 caches, where the CPU has AMX's
bfloat16 tiles and the process is granted them (`amx_build`), the amx_bf16 build runs them on the
tiles (csrc/prefill_attention_amx.h): queries and probabilities as pairs of bfloat16, float32 sums,
float32's result within ~1e-5.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Optional

import torch

from kernels import checks as _common

from kernels.cpu import build as cpu_build
from kernels.cpu.decode_attention import CACHE_DTYPES, SUFFIX

log = logging.getLogger(__name__)

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURE = (_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I)
NAME = "prefill_attention"


AMX_BUILD = "amx_bf16"  # kernels/cpu/build.py ISA_FLAGS
AMX_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16")
PROBE_SUM = 8704.0  # what csrc/prefill_attention.c's `probe` returns: 64 x (1 + 2 + .. + 16)
PROBE_REFUSED = -1.0  # ... and where the kernel refuses the process the tiles


@functools.lru_cache(maxsize=None)
def amx_build() -> Optional[str]:
    """AMX_BUILD where /proc/cpuinfo lists AMX_NEEDS and the build's probe ran on the tiles in a
    child process (a VM may list AMX and kill the process that runs it); else None (-march=native).
    INFLIGHT_CPU_ISA set to a build without AMX (kernels/cpu/quant.py BUILDS) turns it off too: one
    switch keeps every kernel off the tiles."""
    forced = os.environ.get("INFLIGHT_CPU_ISA")
    if forced and not forced.startswith("amx"):
        return None
    isa, passed_over = cpu_build.first_that_runs((AMX_BUILD, "native"), {AMX_BUILD: AMX_NEEDS}, _probe_runs)
    if isa != AMX_BUILD:
        log.info("prefill attention: not on AMX's tiles (%s)", passed_over[AMX_BUILD])
        return None
    return AMX_BUILD


def _probe_runs(isa: str) -> tuple[bool, str]:
    from kernels.cpu.quant import probe_library  # one way to probe a build

    try:
        return probe_library(cpu_build.build(NAME, isa), PROBE_SUM)
    except cpu_build.CpuKernelUnavailable as e:  # an older gcc without -mamx-bf16
        return False, f"it did not compile ({str(e).splitlines()[-1][:200]})"


def kernel_for(cache_dtype: torch.dtype, isa: Optional[str] = None):
    """The C function for caches of `cache_dtype`: from `isa`'s build, else bfloat16 caches' from
    `amx_build()` where it runs, else the -march=native build's. The C layer stack
    (kernels/cpu/decode_stack.py) takes the same, so both paths' numbers agree."""
    if isa is None and cache_dtype == torch.bfloat16:
        isa = amx_build()
    return cpu_build.function(NAME, f"prefill_attention_{SUFFIX[cache_dtype]}", SIGNATURE, isa)


def check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, window: int = 0) -> None:
    """Every shape, dtype and bound the C code relies on (it checks nothing itself): those shared
    with the other paged kernels (`_common.check_paged_attention`), float32 CPU contiguous tensors,
    int32 indices, chunk offsets that rise from 0 to T, and each chunk no longer than its sequence."""
    _common.check_paged_attention(NAME, q, "[num_tokens, num_heads, head_dim]", k_cache, v_cache,
                                  block_tables, seq_lens, scale, cache_dtype_may_differ=True, window=window)
    t, (nb, bs) = q.shape[0], k_cache.shape[:2]
    for name, x, dtypes in (("q", q, (torch.float32,)), ("k_cache", k_cache, CACHE_DTYPES),
                            ("v_cache", v_cache, CACHE_DTYPES)):
        if x.dtype not in dtypes or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"{NAME}: {name} must be a contiguous CPU tensor of "
                             f"{' or '.join(str(d) for d in dtypes)}; got {x.dtype} on {x.device}")
    check_chunks(NAME, "prefill", cu_seqlens_q, seq_lens, block_tables, t, nb, bs)


def check_chunks(name: str, key: str, cu_seqlens_q, seq_lens, block_tables, rows: int, num_blocks: int,
                 block_size: int) -> None:
    """The prompt rows' index tensors (also the C layer stack's, kernels/cpu/decode_stack.py):
    seq_lens int32 [S]; block_tables int32 [.., S, MB] (the stack's carry the KV-cache groups
    first); cu_seqlens_q int32 [S + 1] rising from 0 to `rows`; each chunk within its sequence's
    length, each length within its table, each block id below num_blocks. `key`: the bounds
    cache's (kernels/checks.py), read once per step."""
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        raise ValueError(f"{name}: seq_lens must be int32 [S]; got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    s = seq_lens.shape[0]
    if block_tables.dtype != torch.int32 or block_tables.dim() < 2 or block_tables.shape[-2] != s \
            or not block_tables.is_contiguous():
        raise ValueError(f"{name}: block_tables must be contiguous int32 [.., {s}, MB]; got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if cu_seqlens_q.dtype != torch.int32 or tuple(cu_seqlens_q.shape) != (s + 1,):
        raise ValueError(f"{name}: cu_seqlens_q must be int32 [{s + 1}]; got {cu_seqlens_q.dtype} "
                         f"{tuple(cu_seqlens_q.shape)}")
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != rows or bool((q_lens < 0).any()):
        raise ValueError(f"{name}: cu_seqlens_q must rise from 0 to the {rows} query rows; got {cu_seqlens_q.tolist()}")
    if bool((q_lens > seq_lens).any()):
        raise ValueError(f"{name}: a chunk is longer than its sequence's seq_lens (the chunk is counted in it)")
    width = block_tables.shape[-1]
    _common.bounds_checked.once(f"{key}_seq_lens", seq_lens, 0, width * block_size + 1,
                                f"{name}: seq_lens (the table holds {width} blocks of {block_size})")
    _common.bounds_checked.once(f"{key}_block_tables", block_tables, 0, num_blocks, f"{name}: block ids")


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                      max_q_len: Optional[int] = None, window: int = 0, isa: Optional[str] = None) -> torch.Tensor:
    """q [T, H, D] (S chunks back to back, at cu_seqlens_q); seq_lens [S] cached tokens of each
    sequence, its chunk's included -> [T, H, D]; window > 0: each query reads only its last
    `window` positions. `isa`: a build of kernels/cpu/build.py's ISA_FLAGS instead of the chosen one
    (`kernel_for`; the tests run every one)."""
    q = q.contiguous()
    block_tables, cu_seqlens_q, seq_lens = block_tables.contiguous(), cu_seqlens_q.contiguous(), seq_lens.contiguous()
    check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, window)
    out = _common.alloc(q.shape, q.dtype, q.device)  # through the module: tests poison it
    t, h, d = q.shape
    _, bs, g, _ = k_cache.shape
    if t:
        kernel_for(k_cache.dtype, isa)(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), cu_seqlens_q.data_ptr(),
               seq_lens.data_ptr(), out.data_ptr(), seq_lens.shape[0], h, g, d, bs, block_tables.shape[1],
               float(scale), window)
    return out
