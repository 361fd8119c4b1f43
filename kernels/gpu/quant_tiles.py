"""What the quantized GEMMs (kernels/gpu/quant_gguf_gemm.py, quant_w8_gemm.py, quant_awq_gemm.py) share:
the tile and split-K choice, the split-K reduction kernel, and the argument checks.

Every quantized GEMM computes out[M, N] = x[M, K] @ W[N, K].T (+ bias) with W dequantized tile by
tile in registers and multiplied with tl.dot, accumulating in float32. Two regimes:

- decode (M <= DECODE_MAX_M): the weights are read once per step and the arithmetic is small, so
  the time is the weight bytes over the memory bandwidth. One M tile (16 or 64 rows; tl.dot needs
  16) covers the batch, and when the N tiles alone cannot fill the GPU (o_proj or down_proj of an
  8B model: 64 tiles of 64 rows for 132 SMs) K is split among programs that write float32 partial
  sums, which `_split_k_reduce_kernel` adds up (with the bias) in a fixed order: deterministic,
  unlike atomics.
- prefill (M > DECODE_MAX_M): compute-bound; bigger tiles, no split.

M is not specialized by the compiler (`do_not_specialize`): it only bounds masks, and a batch of
1, 16 or 37 rows then runs the same binary, the one kernels.aot compiled.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch

DECODE_MAX_M = 64
DECODE_M_TILES = (16, DECODE_MAX_M)   # the decode regime's M tiles: batches of <= 16 rows, and of 17-64
MAX_SPLITS = 16
MIN_K_TILES_PER_SPLIT = 4   # each split streams at least this many K tiles (launch cost amortized)
PROGRAMS_PER_SM = 2         # decode: aim for this many programs per SM, by splitting K
ACT_DTYPES = C.FLOAT_DTYPES


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int        # programs along K
    k_per_split: int    # a multiple of block_k: the K range of one split
    num_warps: int
    num_stages: Optional[int] = None

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return (C.cdiv(n, self.block_n), C.cdiv(m, self.block_m), self.split_k)


def plan_tiles(m: int, n: int, k: int, device: torch.device, block_k: int = 128,
               split_k: Optional[int] = None, sms: Optional[int] = None, k_group: Optional[int] = None) -> Tiles:
    """Tiles for an [M, K] x [K, N] product. `block_k` is the decode K tile (a multiple of every
    family's group width); `split_k` forces a split count (tests, benchmarks), else it is chosen
    for `sms` streaming multiprocessors (default: the device's; kernels.aot plans for real GPUs).
    With `k_group`, the K tile divides it (a tile never straddles two groups of scales)."""
    if m > DECODE_MAX_M:
        bm, bn, bk, warps, stages = 64, 128, 64, 8, 3
        want = 1
    else:
        bm, bn, bk, warps, stages = next(t for t in DECODE_M_TILES if m <= t), 64, block_k, 4, None
        tiles = max(1, C.cdiv(n, bn) * C.cdiv(m, bm))
        want = max(1, PROGRAMS_PER_SM * (sms or C.num_sms(device)) // tiles)
        want = min(want, MAX_SPLITS, max(1, C.cdiv(k, bk) // MIN_K_TILES_PER_SPLIT))
    if k_group is not None:
        bk = min(bk, k_group & -k_group)          # the largest power of two dividing the group
    if split_k is not None:
        if not 1 <= split_k <= MAX_SPLITS:
            raise ValueError(f"split_k must be in [1, {MAX_SPLITS}]; got {split_k}")
        want = split_k
    k_per_split = C.cdiv(C.cdiv(k, bk), want) * bk
    return Tiles(bm, bn, bk, C.cdiv(k, k_per_split), k_per_split, warps, stages)


@triton.jit
def program_tile(M, N, K, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The grid is (N tiles, M tiles, K splits): this program's output rows [BLOCK_M], columns
    [BLOCK_N], their masks, and its range of K [k_start, k_end)."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_PER_SPLIT
    return offs_m, offs_n, offs_m < M, offs_n < N, k_start, tl.minimum(K, k_start + K_PER_SPLIT)


@triton.jit
def store_tile(acc, bias_ptr, out_ptr, part_ptr, M, N, offs_m, offs_n, stride_om, stride_on,
               HAS_BIAS: tl.constexpr):
    """A program's [BLOCK_M, BLOCK_N] float32 sums: with K split (a runtime choice, so one binary
    serves both), into the contiguous partials [S, M, N]; else (+ bias) into out, in its dtype."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    m64 = offs_m.to(tl.int64)[:, None]
    if tl.num_programs(2) > 1:
        dst = part_ptr + tl.program_id(2).to(tl.int64) * M * N + m64 * N + offs_n[None, :]
        tl.store(dst, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m64 * stride_om + offs_n[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, SPLITS,
    stride_ps, stride_pm, stride_pn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + offs * stride_pn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


def plan_split_k_reduce(partials: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> Launch:
    """partials [S, M, N] float32 -> out [M, N] = sum over S (+ bias), in out's dtype."""
    s, m, n = partials.shape
    block = min(1024, C.next_pow2(n))
    return Launch(_split_k_reduce_kernel, (m, C.cdiv(n, block)),
                  (partials, bias if bias is not None else partials, out, m, n, s, *partials.stride(),
                   *out.stride()),
                  dict(HAS_BIAS=bias is not None, BLOCK=block), num_warps=4)


def check_activations(name: str, x: torch.Tensor, k: int) -> None:
    """x [M, K] in a float dtype, K matching the weight's inputs."""
    C.check_ndim(name, "x", x, 2, "[tokens, in_features]")
    C.check_dtype(name, "x", x, ACT_DTYPES)
    if x.shape[1] != k:
        raise ValueError(f"{name}: x has {x.shape[1]} features; the weight takes {k}")


def check_bias(name: str, bias: Optional[torch.Tensor], n: int) -> None:
    if bias is None:
        return
    C.check_dtype(name, "bias", bias, C.FLOAT_DTYPES)
    if bias.shape != (n,) or bias.stride(0) != 1:
        raise ValueError(f"{name}: bias must be a contiguous ({n},) vector; got shape {tuple(bias.shape)}")


def check_array(name: str, arg: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple) -> None:
    """A weight array: exact shape and dtype, its last dimension contiguous (the kernels read bytes
    along a row with unit stride; rows may be strided, e.g. one part of a fused matrix)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: {arg} must have shape {tuple(shape)}; got {tuple(t.shape)}")
    C.check_dtype(name, arg, t, dtypes)
    if t.dim() > 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: {arg} must be contiguous along its last dimension; got strides {t.stride()}")


def epilogue_args(bias: Optional[torch.Tensor], out: torch.Tensor, partials: Optional[torch.Tensor]) -> tuple:
    """store_tile's pointers and HAS_BIAS. With K split the reduction adds the bias, and store_tile
    gets `out` in its place (never read); without, a cached float32 stand-in for the partials (never
    written). So a launch's signature (pointer dtypes included) depends only on what it uses."""
    if partials is not None:
        return (out, out, partials), False
    return (bias if bias is not None else out, out, _no_partials(out.device)), bias is not None


@functools.lru_cache(maxsize=None)
def _no_partials(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def launches(main: Launch, tiles: Tiles, partials: Optional[torch.Tensor], bias: Optional[torch.Tensor],
             out: torch.Tensor) -> list[Launch]:
    """The main launch, then the reduction when K was split."""
    return [main] if tiles.split_k == 1 else [main, plan_split_k_reduce(partials, bias, out)]


def outputs(x: torch.Tensor, n: int, tiles: Tiles) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The result [M, N] in x's dtype and, when K is split, the float32 partials [S, M, N]."""
    m = x.shape[0]
    out = C.alloc((m, n), x.dtype, x.device)
    partials = C.alloc((tiles.split_k, m, n), torch.float32, x.device) if tiles.split_k > 1 else None
    return out, partials


def prepare(name: str, x: torch.Tensor, n: int, k: int, arrays: list[torch.Tensor], bias: Optional[torch.Tensor],
            split_k: Optional[int], k_group: Optional[int] = None
            ) -> tuple[Tiles, torch.Tensor, Optional[torch.Tensor]]:
    """A family wrapper's checks of x and bias against its checked weight ([N, K]), then its tiles,
    output and partials."""
    check_activations(name, x, k)
    check_bias(name, bias, n)
    C.check_device(name, x, *arrays, *([bias] if bias is not None else []))
    tiles = plan_tiles(x.shape[0], n, k, x.device, split_k=split_k, k_group=k_group)
    return (tiles, *outputs(x, n, tiles))


def run(out: torch.Tensor, plans: list[Launch]) -> torch.Tensor:
    for launch in plans:
        launch()
    return out
