"""KV-cache store: write each token's key/value heads into its slot of the paged cache.

Cache layout [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset;
a slot of -1 means "do not store" (padding tokens). One program per token moves all of its kv heads
(a [G, D] tile) for both K and V, converting to the cache dtype. An fp8 (e4m3) cache stores the
values saturated to e4m3's range (+-448), with no scale: vLLM's default, its k/v scales of 1.0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch
from kernels.quant_formats import FP8_MAX as _FP8_MAX

FP8_MAX = tl.constexpr(_FP8_MAX)  # e4m3's largest finite value, as the kernel reads it


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_g < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)

    k = tl.load(key_ptr + tok64 * stride_kt + offs_g[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    if SATURATE:  # fp8: out-of-range values become +-448, never NaN, whatever the conversion does
        k = tl.minimum(tl.maximum(k.to(tl.float32), -FP8_MAX), FP8_MAX)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kco
    tl.store(kc + offs_g[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(value_ptr + tok64 * stride_vt + offs_g[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    if SATURATE:
        v = tl.minimum(tl.maximum(v.to(tl.float32), -FP8_MAX), FP8_MAX)
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vco
    tl.store(vc + offs_g[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, G, D] into the paged cache at slot_mapping [T] (in place); slot -1 skips.

    key/value may be strided views (e.g. slices of a fused qkv projection). Slots must be unique and
    below num_blocks * block_size; that is not checked here (it would need a device sync).
    """
    name = "store_kv"
    C.check_ndim(name, "key", key, 3, "[tokens, num_kv_heads, head_dim]")
    if value.shape != key.shape:
        raise ValueError(f"{name}: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    C.check_cache(name, k_cache, v_cache)
    C.check_dtype(name, "key", key, C.FLOAT_DTYPES)
    C.check_dtype(name, "value", value, C.FLOAT_DTYPES)
    C.check_dtype(name, "slot_mapping", slot_mapping, C.INDEX_DTYPES)
    t, g, d = key.shape
    _, bs, cg, cd = k_cache.shape
    if (cg, cd) != (g, d):
        raise ValueError(f"{name}: key has {g} kv heads of dim {d} but the cache holds {cg} of dim {cd}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"{name}: slot_mapping must have shape ({t},); got {tuple(slot_mapping.shape)}")
    if slot_mapping.stride(0) != 1 and t > 1:
        raise ValueError(f"{name}: slot_mapping must be contiguous")
    C.check_device(name, key, value, k_cache, v_cache, slot_mapping)
    if t == 0:
        return
    plan_store_kv(key, value, k_cache, v_cache, slot_mapping)()


def plan_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> Launch:
    """The launch store_kv makes for checked arguments (kernels.aot compiles the same)."""
    t, g, d = key.shape
    return Launch(
        _store_kv_kernel, (t,),
        (key, value, k_cache, v_cache, slot_mapping,
         *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride()),
        dict(NUM_KV_HEADS=g, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
             BLOCK_G=C.next_pow2(g), BLOCK_D=C.next_pow2(d), SATURATE=k_cache.dtype in C.FP8_DTYPES),
        num_warps=4 if g * d >= 1024 else 1,
    )
