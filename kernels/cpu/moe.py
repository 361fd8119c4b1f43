"""The experts of a mixture-of-experts layer on the CPU in one C call per projection
(kernels/cpu/csrc/moe_gemm.c), on weights laid out once for it.

- `pack_panels(w)`: stacked expert weights [E, N, K] (float32 or bfloat16) -> the kernel's panels
  of 16 output columns, K-major (moe_gemm.c's header); done at load, the only copy kept.
- `expert_gemm(x, panels, n, offsets)`: rows sorted by expert, expert e's rows offsets[e] ..
  offsets[e + 1] - 1 -> x @ W[e]^T for each, [R, n] float32. Its oracle:
  kernels/moe_reference.py `expert_gemm` (the same product in float64), within float32 rounding.
- `sorted_moe(x, topk_weights, topk_ids, E, gate_up, down, silu_mul)`: the whole experts'
  computation as kernels/moe_reference.py `grouped_moe` does it per expert (its oracle): the
  (token, slot) pairs sorted by expert, one call for every active expert's gate/up, SiLU·mul, one
  call for every down projection, the outputs weighted and added into their tokens in float32.
  `grouped_moe` runs it on panels; packed quantized experts run it on kernels/cpu/quant.py
  `CpuQuantExperts` (the int8 kernel's tiles, one call per projection too).

Why a kernel of our own: docs/performance.md, "Mixture of experts on the CPU" (a decode batch
gives each expert ~16 rows; oneDNN at 16 rows is far from its speed at 64, and the weights stream
from memory; this kernel overlaps the two).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Callable

import torch

from kernels import checks as _common

from kernels.cpu import build as cpu_build
from kernels.cpu import huge_pages
from kernels.cpu import onednn
log = logging.getLogger(__name__)

NAME = "moe_gemm"
PANEL = 16
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURE = (ctypes.c_int, _P, _I, _P, _P, _I, _I, _I, _P, _I, _P)
# rows [R, K] float32 sorted by expert, offsets int64 [E + 1] -> [R, N] float32: every active
# expert's product in one call (expert_gemm on panels; CpuQuantExperts.matmul on packed experts)
GroupedGemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def available() -> bool:
    """Whether the kernel builds here (a C compiler); the caller keeps per-expert layers if not."""
    try:
        cpu_build.load(NAME)
        return True
    except cpu_build.CpuKernelUnavailable as exc:
        log.warning("grouped-experts CPU kernel unavailable, using one oneDNN GEMM per expert: %s", exc)
        return False


def panels_serve(dtype: torch.dtype) -> bool:
    """Whether the kernel's panels serve experts of `dtype` better than one oneDNN GEMM per expert:
    float32 always; bfloat16 unless oneDNN runs AMX, whose tile GEMM ties the kernel at a decode
    batch's ~16 rows an expert and is 2.5x faster at 64 (docs/performance.md, "Mixture of experts
    on the CPU"); without AMX the kernel is 4x (AVX512_BF16) to 13x (AVX-512) faster."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and not onednn.runs_amx_bf16())


def _fn(isa=None):
    return cpu_build.function(NAME, "moe_gemm", _SIGNATURE, isa)


@functools.lru_cache(maxsize=None)
def build_config(isa=None) -> dict:
    """What the build chose for this CPU: rows per block against one panel and against two."""
    cfg = (ctypes.c_int64 * 3)()
    fn = cpu_build.load(NAME, isa).moe_gemm_config
    fn.restype, fn.argtypes = None, [_P]
    fn(ctypes.addressof(cfg))
    return dict(panel=cfg[0], rows_one_panel=cfg[1], rows_two_panels=cfg[2])


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """w [E, N, K] -> float32: [E, P, K, 16]; bfloat16: [E, P, ceil(K / 2), 16, 2] (k and k + 1 side
    by side); P = ceil(N / 16), zero columns (and a zero k) as padding."""
    if w.dim() != 3 or w.dtype not in DTYPES:
        raise ValueError(f"pack_panels: expected stacked weights [E, N, K] of float32 or bfloat16; "
                         f"got {w.dtype} {tuple(w.shape)}")
    e, n, k = w.shape
    p = -(-n // PANEL)
    w = w.detach().cpu()
    if p * PANEL != n:
        w = torch.nn.functional.pad(w, (0, 0, 0, p * PANEL - n))
    if w.dtype == torch.float32:
        src = w.view(e, p, PANEL, k).transpose(2, 3)
    else:
        src = torch.nn.functional.pad(w, (0, k % 2)).view(e, p, PANEL, -1, 2).permute(0, 1, 3, 2, 4)
    # streamed every step, hundreds of MB: in 2 MB pages (with 4 KB ones every 4 KB cost a TLB walk that the
    # kernel's prefetches waited on: 16% of the grouped GEMMs' time at 16 rows an expert, docs/performance.md)
    return huge_pages.empty(tuple(src.shape), w.dtype).copy_(src)


def panel_shape(panels: torch.Tensor) -> tuple[int, int, int]:
    """(experts, output columns rounded up to panels, input size rounded up for bf16's pairs)."""
    return panels.shape[0], panels.shape[1] * PANEL, panels.shape[2] * (1 if panels.dtype == torch.float32 else 2)


def _check(x: torch.Tensor, panels: torch.Tensor, n: int, offsets: torch.Tensor) -> None:
    if panels.dtype not in DTYPES or panels.device.type != "cpu" or not panels.is_contiguous():
        raise ValueError(f"expert_gemm: panels must be a contiguous CPU tensor of float32 or bfloat16 "
                         f"(pack_panels); got {panels.dtype} on {panels.device}")
    want_dims = 4 if panels.dtype == torch.float32 else 5
    if panels.dim() != want_dims or panels.shape[3] != PANEL or (want_dims == 5 and panels.shape[4] != 2):
        raise ValueError(f"expert_gemm: panels of shape {tuple(panels.shape)} are not pack_panels' layout")
    experts, columns, k_padded = panel_shape(panels)
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expert_gemm: x must be float32 [R, K] on the CPU with contiguous rows; got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
    k = x.shape[1]
    if k_padded != (k if panels.dtype == torch.float32 else k + k % 2):
        raise ValueError(f"expert_gemm: x has K = {k} inputs; the panels hold {k_padded}")
    if not columns - PANEL < n <= columns:
        raise ValueError(f"expert_gemm: n = {n} outputs; the panels hold {columns - PANEL + 1} to {columns}")
    if offsets.dtype != torch.int64 or offsets.device.type != "cpu" or tuple(offsets.shape) != (experts + 1,):
        raise ValueError(f"expert_gemm: offsets must be int64 [{experts + 1}] on the CPU; got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"expert_gemm: offsets must rise from 0 to the {x.shape[0]} rows of x; got {bounds}")


def expert_gemm(x: torch.Tensor, panels: torch.Tensor, n: int, offsets: torch.Tensor, isa=None) -> torch.Tensor:
    """x [R, K] float32, rows sorted by expert; panels from pack_panels; offsets int64 [E + 1]
    (expert e's rows are offsets[e] .. offsets[e + 1] - 1) -> [R, n] float32. ``isa`` picks a
    build other than -march=native's (cpu_build.ISA_FLAGS; the tests run every one)."""
    _check(x, panels, n, offsets)
    rows, k = x.shape
    out = _common.alloc((rows, n), torch.float32, x.device)
    if rows:
        scratch = _common.alloc((rows * (k + k % 2),), torch.float32, x.device)
        _fn(isa)(DTYPES[panels.dtype], x.data_ptr(), x.stride(0) if rows > 1 else k, panels.data_ptr(),
                 offsets.data_ptr(), panels.shape[0], n, k, out.data_ptr(), n, scratch.data_ptr())
    return out


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of topk_ids [T, K] grouped by expert, token order kept: (order [T K],
    the pair numbers in that order; offsets int64 [E + 1], expert e's pairs at places offsets[e] ..
    offsets[e + 1] - 1; tokens [T K], each sorted pair's token)."""
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"grouped experts: expert ids reach {counts.numel() - 1}; there are {num_experts} experts")
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return order, offsets, order // topk_ids.shape[1]


def sorted_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
               gate_up: GroupedGemm, down: GroupedGemm, silu_mul) -> torch.Tensor:
    """The experts' output [T, H] (x's dtype, summed in float32) for x [T, H]: the (token, slot)
    pairs sorted by expert, token order kept; `gate_up(rows, offsets)` once for every active
    expert's [gate | up] ([R, H] float32 rows sorted by expert, offsets int64 [E + 1] -> [R, 2I]),
    `silu_mul` ([R, 2I] -> [R, I]), `down(rows, offsets)` once for every down projection; the
    outputs weighted and added into their tokens. kernels/moe_reference.py `grouped_moe` (one GEMM
    pair per expert) is its oracle."""
    t, hidden = x.shape
    order, offsets, tokens = sort_pairs(topk_ids, num_experts)
    y = down(silu_mul(gate_up(x.index_select(0, tokens).float(), offsets)), offsets)
    y.mul_(topk_weights.reshape(-1)[order].float()[:, None])
    return torch.zeros(t, hidden, dtype=torch.float32).index_add_(0, tokens, y).to(x.dtype)


def grouped_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, intermediate: int, silu_mul, isa=None) -> torch.Tensor:
    """The experts' output [T, H] (x's dtype) for x [T, H] float32, w13 = pack_panels(every
    expert's [gate | up] [E, 2I, H]), w2 = pack_panels([E, H, I]); `silu_mul` [R, 2I] -> [R, I]."""
    return sorted_moe(x, topk_weights, topk_ids, w13.shape[0],
                      lambda rows, offsets: expert_gemm(rows, w13, 2 * intermediate, offsets, isa),
                      lambda rows, offsets: expert_gemm(rows, w2, x.shape[1], offsets, isa), silu_mul)
