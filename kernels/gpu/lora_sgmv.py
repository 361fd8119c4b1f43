"""Segmented LoRA shrink and expand (punica's SGMV; vLLM's lora_shrink / lora_expand): one launch
each per fused projection, whatever mix of adapters the step holds.

Layouts and semantics are kernels/lora_reference.py's (the torch reference, same signatures).
Segments come as int32 device tensors (first row, rows, slot; slot -1: no segment), so a launch
reads no host value but `segments.max_len` (its grid), and the same launch serves any mix.

shrink: program (row block, column block of shards x R, segment): y = x[rows] @ a_bank[slot].T,
        fp32 accumulation, y kept in float32.
expand: program (row block, column block, segment x shard): out[rows, shard's columns] +=
        y[rows, shard's R] @ b_bank[slot, shard's rows].T, in place. The shards' column bounds
        (q | k | v, gate | up) are constexprs: they are the model's shapes.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch
from kernels.lora_reference import Segments

BLOCK_M = 16      # rows per program (tl.dot wants 16 at least)
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
MAX_SHARDS = 3


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, y_ptr, starts_ptr, lens_ptr, slots_ptr,
    stride_xt, stride_xk, stride_as, stride_an, stride_ak, stride_yt, stride_yn,
    K, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(2)
    slot = tl.load(slots_ptr + seg)
    length = tl.load(lens_ptr + seg)
    m0 = tl.program_id(0) * BLOCK_M
    if (slot < 0) | (m0 >= length):
        return
    start = tl.load(starts_ptr + seg).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = offs_m < length
    rows = start + offs_m
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None] * stride_ak,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(x, a.to(x.dtype), input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * stride_yt + offs_n[None, :] * stride_yn, acc,
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr, b_ptr, out_ptr, starts_ptr, lens_ptr, slots_ptr,
    stride_yt, stride_yn, stride_bs, stride_bn, stride_br, stride_ot, stride_on,
    NUM_SHARDS: tl.constexpr, BOUND1: tl.constexpr, BOUND2: tl.constexpr, BOUND3: tl.constexpr,
    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seg = tl.program_id(2) // NUM_SHARDS
    shard = tl.program_id(2) % NUM_SHARDS
    slot = tl.load(slots_ptr + seg)
    length = tl.load(lens_ptr + seg)
    m0 = tl.program_id(0) * BLOCK_M
    lo = tl.where(shard == 0, 0, tl.where(shard == 1, BOUND1, BOUND2))
    hi = tl.where(shard == 0, BOUND1, tl.where(shard == 1, BOUND2, BOUND3))
    n0 = lo + tl.program_id(1) * BLOCK_N
    if (slot < 0) | (m0 >= length) | (n0 >= hi):
        return
    start = tl.load(starts_ptr + seg).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = offs_m < length
    rows = start + offs_m
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    offs_r = tl.arange(0, RANK)
    y = tl.load(y_ptr + rows[:, None] * stride_yt + (shard * RANK + offs_r)[None, :] * stride_yn,
                mask=row_mask[:, None], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                mask=n_mask[None, :], other=0.0)
    delta = tl.dot(y.to(b.dtype), b, input_precision="ieee")
    mask = row_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def _check(name: str, x: torch.Tensor, bank: torch.Tensor, segments: Segments) -> None:
    C.check_ndim(name, "x", x, 2, "[tokens, features]")
    C.check_ndim(name, "bank", bank, 3, "[slots, rows, cols]")
    C.check_dtype(name, "x", x, C.FLOAT_DTYPES)
    C.check_dtype(name, "bank", bank, C.FLOAT_DTYPES)
    if segments.starts is None or segments.lens is None or segments.slots is None:
        raise ValueError(f"{name}: segments need their device tensors (starts, lens, slots)")
    for arg in ("starts", "lens", "slots"):
        t = getattr(segments, arg)
        C.check_dtype(name, f"segments.{arg}", t, (torch.int32,))
        if t.dim() != 1 or t.shape[0] != segments.starts.shape[0] or (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(f"{name}: segments.{arg} must be 1-D, contiguous, all of one length; got shape "
                             f"{tuple(t.shape)}, stride {tuple(t.stride())}")
    C.check_device(name, x, bank, segments.starts, segments.lens, segments.slots)
    if segments.max_len > x.shape[0]:
        raise ValueError(f"{name}: segments.max_len {segments.max_len} exceeds the {x.shape[0]} rows")


def lora_shrink(x: torch.Tensor, a_bank: torch.Tensor, segments: Segments) -> torch.Tensor:
    """x [T, K], a_bank [S, shards*R, K] -> y [T, shards*R] float32 (rows outside the segments unwritten)."""
    name = "lora_shrink"
    _check(name, x, a_bank, segments)
    if a_bank.shape[2] != x.shape[1]:
        raise ValueError(f"{name}: a_bank's last dim {a_bank.shape[2]} != x's features {x.shape[1]}")
    y = C.alloc((x.shape[0], a_bank.shape[1]), torch.float32, x.device)
    if segments.max_len and segments.starts.numel():
        plan_lora_shrink(x, a_bank, y, segments)()
    return y


def plan_lora_shrink(x: torch.Tensor, a_bank: torch.Tensor, y: torch.Tensor, segments: Segments) -> Launch:
    k, n = x.shape[1], a_bank.shape[1]
    block_n = max(16, min(64, C.next_pow2(n)))
    grid = (C.cdiv(max(segments.max_len, 1), BLOCK_M), C.cdiv(n, block_n), segments.starts.shape[0])
    return Launch(_lora_shrink_kernel, grid,
                  (x, a_bank, y, segments.starts, segments.lens, segments.slots, *x.stride(), *a_bank.stride(),
                   *y.stride(), k, n),
                  dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=SHRINK_BLOCK_K), num_warps=4)


def lora_expand(y: torch.Tensor, b_bank: torch.Tensor, shard_bounds: Sequence[int], segments: Segments,
                out: torch.Tensor) -> torch.Tensor:
    """out [T, N] += each shard's y slice @ its lora_B rows, per segment, in place; returns out."""
    name = "lora_expand"
    _check(name, out, b_bank, segments)
    C.check_dtype(name, "y", y, (torch.float32,))
    shards = len(shard_bounds) - 1
    rank = b_bank.shape[2]
    if not 1 <= shards <= MAX_SHARDS or shard_bounds[0] != 0 or list(shard_bounds) != sorted(shard_bounds):
        raise ValueError(f"{name}: shard_bounds must rise from 0 with 1..{MAX_SHARDS} shards; got {list(shard_bounds)}")
    if shard_bounds[-1] != out.shape[1] or b_bank.shape[1] != out.shape[1]:
        raise ValueError(f"{name}: out has {out.shape[1]} columns, b_bank {b_bank.shape[1]} rows, the shards "
                         f"end at {shard_bounds[-1]}; all three must agree")
    if rank < 16 or rank & (rank - 1):
        raise ValueError(f"{name}: the bank's rank {rank} must be a power of two >= 16 (tl.dot's tile)")
    if y.shape != (out.shape[0], shards * rank):
        raise ValueError(f"{name}: y must be [{out.shape[0]}, {shards * rank}]; got {tuple(y.shape)}")
    if segments.max_len and segments.starts.numel():
        plan_lora_expand(y, b_bank, shard_bounds, segments, out)()
    return out


def plan_lora_expand(y: torch.Tensor, b_bank: torch.Tensor, shard_bounds: Sequence[int], segments: Segments,
                     out: torch.Tensor) -> Launch:
    shards = len(shard_bounds) - 1
    bounds = list(shard_bounds[1:]) + [shard_bounds[-1]] * (MAX_SHARDS - shards)
    widest = max(b - a for a, b in zip(shard_bounds, shard_bounds[1:]))
    grid = (C.cdiv(max(segments.max_len, 1), BLOCK_M), C.cdiv(widest, EXPAND_BLOCK_N), segments.starts.shape[0] * shards)
    return Launch(_lora_expand_kernel, grid,
                  (y, b_bank, out, segments.starts, segments.lens, segments.slots, *y.stride(), *b_bank.stride(),
                   *out.stride()),
                  dict(NUM_SHARDS=shards, BOUND1=bounds[0], BOUND2=bounds[1], BOUND3=bounds[2],
                       RANK=b_bank.shape[2], BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N), num_warps=4)


def lora_add(out: torch.Tensor, x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
             shard_bounds: Sequence[int], segments: Segments) -> torch.Tensor:
    """out += the LoRA delta of every segment (shrink then expand); returns out."""
    return lora_expand(lora_shrink(x, a_bank, segments), b_bank, shard_bounds, segments, out)
