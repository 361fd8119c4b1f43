"""Fused mixture-of-experts (vLLM's `fused_moe`): every active expert's MLP in two launches,
whatever the routing.

1. `moe_align_block_size` (kernels/moe_reference.py, device-side torch ops) sorts the (token,
   slot) pairs by expert and pads each expert's run to whole blocks of BLOCK_M rows, so that each
   block of rows is one expert's.
2. The gate/up launch: program (row block, column block) multiplies its block's tokens by its
   expert's gate rows and up rows (w13 [E, 2I, H], two accumulators), applies silu(gate) * up in
   the epilogue and writes the pair's activation row, [T*K, I]: the [T*K, 2I] product never goes
   to memory.
3. The down launch: the same kernel over the activations with w2 [E, H, I], each output row
   scaled by its pair's routing weight, [T*K, H]; the K rows of a token are then summed in float32.

Blocks past the rows in use (or of no expert) return at once, so the grid depends on the shapes
only (T, K, E, BLOCK_M): with the sort on the device, a step reads nothing back and a decode step
is captured in a CUDA graph like any other. fp32 accumulation; the activation and each weighted
expert output are rounded to the activations' dtype, as the reference rounds them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch
from kernels.moe_reference import moe_align_block_size


@triton.jit(do_not_specialize=["num_pairs"])   # changes every step: one variant serves all
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    N: tl.constexpr, K: tl.constexpr, A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    a_rows = (pair // A_ROW_DIV).to(tl.int64)     # gate/up: a token's row serves its K pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
        if GATED:   # the up rows sit N rows below the gate rows
            b_up = tl.load(b_base + (offs_n + N)[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                           mask=b_mask, other=0.0)
            acc_up += tl.dot(a, b_up, input_precision="ieee")
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=row_mask, other=0.0)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


SMALL_RUNS = 32   # pairs per expert on average up to which the 16-row blocks serve


@dataclass(frozen=True)
class MoEBlocks:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def moe_blocks(num_pairs: int, num_experts: int) -> MoEBlocks:
    """The tiles for a step of `num_pairs` (token, slot) pairs: 16-row blocks while an expert gets
    few rows on average (decode: padding a run of 2 rows to 64 would waste 97% of the work), 64-row
    ones past that (prefill), as vLLM's default configuration does. Two configurations only, so
    the warm-up's decode and prefill steps compile both; shapes only, so a graph's launches and
    kernels.aot's are the ones planned here."""
    if num_pairs <= SMALL_RUNS * max(num_experts, 1):
        return MoEBlocks(16, 64, 64, 4)
    return MoEBlocks(64, 64, 32, 4)


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    name = "fused_moe"
    C.check_ndim(name, "x", x, 2, "[tokens, hidden]")
    C.check_ndim(name, "w13", w13, 3, "[experts, 2 * intermediate, hidden]")
    C.check_ndim(name, "w2", w2, 3, "[experts, hidden, intermediate]")
    C.check_ndim(name, "topk_weights", topk_weights, 2, "[tokens, top_k]")
    C.check_ndim(name, "topk_ids", topk_ids, 2, "[tokens, top_k]")
    C.check_dtype(name, "x", x, C.FLOAT_DTYPES)
    C.check_dtype(name, "topk_weights", topk_weights, (torch.float32,))
    C.check_dtype(name, "topk_ids", topk_ids, C.INDEX_DTYPES)
    for arg, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name}: {arg} dtype {w.dtype} != x dtype {x.dtype}")
    e, i2, h = w13.shape
    if h != x.shape[1] or i2 % 2:
        raise ValueError(f"{name}: w13 must be [experts, 2 * intermediate, {x.shape[1]}]; got {tuple(w13.shape)}")
    if tuple(w2.shape) != (e, h, i2 // 2):
        raise ValueError(f"{name}: w2 must be [{e}, {h}, {i2 // 2}] to match w13 {tuple(w13.shape)}; "
                         f"got {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [{x.shape[0]}, top_k]")
    if not 1 <= topk_ids.shape[1] <= e:
        raise ValueError(f"{name}: top_k {topk_ids.shape[1]} must lie in [1, {e}] (the experts)")
    C.check_device(name, x, w13, w2, topk_weights, topk_ids)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, H]: sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) (kernels/moe_reference.py)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    t, top_k = topk_ids.shape
    e, i2, h = w13.shape
    if t == 0:
        return x.new_zeros(0, h)
    blocks = moe_blocks(t * top_k, e)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, e, blocks.block_m)
    act = C.alloc((t * top_k, i2 // 2), x.dtype, x.device)
    y = C.alloc((t * top_k, h), x.dtype, x.device)
    for launch in plan_fused_moe(x, w13, w2, topk_weights.contiguous(), sorted_ids, expert_ids, num_padded,
                                 act, y, top_k):
        launch()
    return torch.sum(y.view(t, top_k, h), dim=1, dtype=torch.float32).to(x.dtype)


def plan_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_padded: torch.Tensor,
                   act: torch.Tensor, y: torch.Tensor, top_k: int) -> list[Launch]:
    """The gate/up and the down launches fused_moe makes (kernels.aot compiles the same)."""
    pairs = act.shape[0]
    e, i2, h = w13.shape
    inter = i2 // 2
    blocks = moe_blocks(pairs, e)
    if sorted_ids.shape[0] % blocks.block_m or expert_ids.shape[0] != sorted_ids.shape[0] // blocks.block_m:
        raise ValueError(f"fused_moe: {sorted_ids.shape[0]} sorted rows and {expert_ids.shape[0]} blocks do not "
                         f"make blocks of {blocks.block_m} rows")
    grid_m = expert_ids.shape[0]
    config = dict(BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k)
    index = (sorted_ids, expert_ids, num_padded, pairs)
    gate_up = Launch(_fused_moe_kernel, (grid_m, C.cdiv(inter, blocks.block_n)),
                     (x, w13, act, topk_weights, *index, *x.stride(), *w13.stride(), *act.stride()),
                     dict(N=inter, K=h, A_ROW_DIV=top_k, GATED=True, MUL_WEIGHT=False, **config),
                     num_warps=blocks.num_warps)
    down = Launch(_fused_moe_kernel, (grid_m, C.cdiv(h, blocks.block_n)),
                  (act, w2, y, topk_weights, *index, *act.stride(), *w2.stride(), *y.stride()),
                  dict(N=h, K=inter, A_ROW_DIV=1, GATED=False, MUL_WEIGHT=True, **config),
                  num_warps=blocks.num_warps)
    return [gate_up, down]
