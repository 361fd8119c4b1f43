"""Rotary position embedding, neox style (rotate-half, as HF Llama).

`rotary_embedding` applies given cos/sin caches [max_pos, D/2] (float32) to q [T, H, D] and
k [T, G, D]: with x = [x1 | x2], out = [x1*cos - x2*sin | x2*cos + x1*sin], fp32 math. One program
per token rotates all of its q and k heads.

The caches themselves are the model's (backend/models/rope.py builds them as HF does).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch


@triton.jit
def _rotate(x_ptr, o_ptr, tok, cos, sin, offs_h, offs_d, mask,
            stride_xt, stride_xh, stride_xd, stride_ot, stride_oh, stride_od, HALF: tl.constexpr):
    x_row = x_ptr + tok * stride_xt + offs_h[:, None] * stride_xh
    o_row = o_ptr + tok * stride_ot + offs_h[:, None] * stride_oh
    x1 = tl.load(x_row + offs_d[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (offs_d[None, :] + HALF) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    tl.store(o_row + offs_d[None, :] * stride_od, y1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + (offs_d[None, :] + HALF) * stride_od, y2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_cp, stride_cd, stride_sp, stride_sd,
    stride_qot, stride_qoh, stride_qod, stride_kot, stride_koh, stride_kod,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_cp + offs_d * stride_cd, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sp + offs_d * stride_sd, mask=mask_d, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]

    offs_hq = tl.arange(0, BLOCK_HQ)
    _rotate(q_ptr, qo_ptr, tok, cos, sin, offs_hq, offs_d,
            (offs_hq < NUM_Q_HEADS)[:, None] & mask_d[None, :],
            stride_qt, stride_qh, stride_qd, stride_qot, stride_qoh, stride_qod, HALF)
    offs_hk = tl.arange(0, BLOCK_HK)
    _rotate(k_ptr, ko_ptr, tok, cos, sin, offs_hk, offs_d,
            (offs_hk < NUM_K_HEADS)[:, None] & mask_d[None, :],
            stride_kt, stride_kh, stride_kd, stride_kot, stride_koh, stride_kod, HALF)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE as in HF Llama. q [T, H, D], k [T, G, D], positions [T]
    (int, each < max_pos: not checked, that would sync), cos/sin caches [max_pos, D/2] float32.
    Returns new contiguous (q, k); the inputs may be strided views."""
    name = "rotary_embedding"
    C.check_ndim(name, "q", q, 3, "[tokens, num_heads, head_dim]")
    C.check_ndim(name, "k", k, 3, "[tokens, num_kv_heads, head_dim]")
    C.check_ndim(name, "cos_cache", cos_cache, 2, "[max_position, head_dim / 2]")
    C.check_dtype(name, "q", q, C.FLOAT_DTYPES)
    C.check_dtype(name, "k", k, C.FLOAT_DTYPES)
    C.check_dtype(name, "positions", positions, C.INDEX_DTYPES)
    C.check_dtype(name, "cos_cache", cos_cache, (torch.float32,))
    C.check_dtype(name, "sin_cache", sin_cache, (torch.float32,))
    t, h, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"{name}: k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} "
                         f"in tokens and head_dim")
    if d % 2:
        raise ValueError(f"{name}: head_dim must be even; got {d}")
    if cos_cache.shape[1] != d // 2 or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"{name}: cos/sin caches must both be [max_position, {d // 2}]; got "
                         f"{tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}")
    if positions.shape != (t,):
        raise ValueError(f"{name}: positions must have shape ({t},); got {tuple(positions.shape)}")
    if t > 1 and positions.stride(0) != 1:
        raise ValueError(f"{name}: positions must be contiguous")
    C.check_device(name, q, k, positions, cos_cache, sin_cache)

    q_out = C.alloc(q.shape, q.dtype, q.device)
    k_out = C.alloc(k.shape, k.dtype, k.device)
    if t == 0:
        return q_out, k_out
    plan_rotary_embedding(q, k, positions, cos_cache, sin_cache, q_out, k_out)()
    return q_out, k_out


def plan_rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                          sin_cache: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor) -> Launch:
    """The launch rotary_embedding makes for checked arguments (kernels.aot compiles the same)."""
    t, h, d = q.shape
    g = k.shape[1]
    block_hq, block_hk, block_d = C.next_pow2(h), C.next_pow2(g), C.next_pow2(d // 2)
    return Launch(
        _rotary_kernel, (t,),
        (q, k, positions, cos_cache, sin_cache, q_out, k_out,
         *q.stride(), *k.stride(), *cos_cache.stride(), *sin_cache.stride(),
         *q_out.stride(), *k_out.stride()),
        dict(NUM_Q_HEADS=h, NUM_K_HEADS=g, HALF=d // 2,
             BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d),
        num_warps=4 if block_hq * block_d >= 1024 else 1,
    )
