"""The CPU engine's elementwise kernels in C (kernels/cpu/csrc/elementwise.c): RMSNorm with the
residual add, SiLU·mul and GELU(tanh)·mul, RoPE and the KV-cache store, one call each.

Same signatures and results as their torch references (kernels/reference.py), which are their
oracles in the tests. In torch each is 5-20 ops; at a small decode batch the dispatch of ~60 ops per
layer was a quarter of SmolLM2's step (docs/performance.md). float32 only, like the C decode
attention they run beside.

Index bounds (positions, slots) need a pass over the index tensor; the engine passes the same
positions and slot mapping to every layer of a step, so a tensor already checked (same object,
unchanged since) is not checked again (`_common.bounds_checked`).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from kernels import checks as _common

from kernels.cpu import build as cpu_build
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm_f32": (_P, _P, _P, _P, _P, _I, _I, _F),
    "silu_mul_f32": (_P, _P, _I, _I),
    "gelu_tanh_mul_f32": (_P, _P, _I, _I),
    "rotary_f32": (_P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I),
    "store_kv_f32": (_P, _I, _P, _I, _P, _P, _P, _I, _I),
    "store_kv_bf16": (_P, _I, _P, _I, _P, _P, _P, _I, _I),
}


def _fn(name: str):
    return cpu_build.function("elementwise", name, _SIGNATURES[name])


def _check_f32(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name}: expected float32 CPU tensors; got {t.dtype} on {t.device}")


def _rows(name: str, t: torch.Tensor, what: str) -> int:
    """The row stride of a [T, ...] tensor whose rows are each contiguous (read off its strides:
    a view op per call would cost more than the kernel at a small batch)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            raise ValueError(f"{name}: each row of {what} must be contiguous; got strides {t.stride()}")
        expected *= size
    return t.stride(0) if t.shape[0] > 1 else expected


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] (+ residual) -> (rmsnorm(h) * weight, h), h = x + residual or x."""
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    _check_f32("rms_norm", x, weight, *([] if residual is None else [residual]))
    t, n = x.shape
    if tuple(weight.shape) != (n,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)} do not agree")
    out, h = _common.alloc((t, n), x.dtype, x.device), _common.alloc((t, n), x.dtype, x.device)
    _fn("rms_norm_f32")(x.data_ptr(), None if residual is None else residual.data_ptr(),
                        weight.contiguous().data_ptr(), out.data_ptr(), h.data_ptr(), t, n, float(eps))
    return out, h


def _gated(name: str, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    _check_f32(name, x)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"{name}: expected [T, 2I]; got {tuple(x.shape)}")
    t, i = x.shape[0], x.shape[1] // 2
    out = _common.alloc((t, i), x.dtype, x.device)
    _fn(f"{name}_f32")(x.data_ptr(), out.data_ptr(), t, i)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    return _gated("silu_mul", x)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] (Gemma's GeGLU)."""
    return _gated("gelu_tanh_mul", x)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE. q [T, H, D], k [T, G, D] (rows may be strided, as the fused qkv split
    leaves them), positions [T] int64, cos/sin [max_pos, D/2] -> new contiguous (q, k)."""
    _check_f32("rotary_embedding", q, k, cos_cache, sin_cache)
    t, h, d = q.shape
    g = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d or d % 2 or tuple(cos_cache.shape[1:]) != (d // 2,) \
            or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)}, k {tuple(k.shape)}, cos/sin "
                         f"{tuple(cos_cache.shape)}/{tuple(sin_cache.shape)} do not agree")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (t,):
        raise ValueError(f"rotary_embedding: positions must be int64 [{t}]; got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    _common.bounds_checked.once("positions", positions, 0, cos_cache.shape[0],
                                "rotary_embedding: positions")
    cos_cache, sin_cache, positions = cos_cache.contiguous(), sin_cache.contiguous(), positions.contiguous()
    q_out, k_out = _common.alloc((t, h, d), q.dtype, q.device), _common.alloc((t, g, d), k.dtype, k.device)
    _fn("rotary_f32")(q.data_ptr(), _rows("rotary_embedding", q, "q"), k.data_ptr(),
                      _rows("rotary_embedding", k, "k"), q_out.data_ptr(), k_out.data_ptr(),
                      positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(), t, h, g, d)
    return q_out, k_out


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, G, D] into the paged cache [NB, BS, G, D] at slot_mapping [T] int64
    (-1: not stored), in place. The cache is float32 or bfloat16 (rounded to nearest even)."""
    _check_f32("store_kv", key, value)
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype \
            or k_cache.device.type != "cpu":
        raise ValueError(f"store_kv: the caches must be float32 or bfloat16 CPU tensors of one dtype; "
                         f"got {k_cache.dtype}, {v_cache.dtype} on {k_cache.device}")
    nb, bs, g, d = k_cache.shape
    t = key.shape[0]
    if tuple(key.shape) != (t, g, d) or value.shape != key.shape or v_cache.shape != k_cache.shape \
            or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError(f"store_kv: key {tuple(key.shape)}, value {tuple(value.shape)} and contiguous "
                         f"caches {tuple(k_cache.shape)} do not agree")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (t,):
        raise ValueError(f"store_kv: slot_mapping must be int64 [{t}]; got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    _common.bounds_checked.once("slots", slot_mapping, -1, nb * bs, "store_kv: slots")
    slot_mapping = slot_mapping.contiguous()
    _fn("store_kv_f32" if k_cache.dtype == torch.float32 else "store_kv_bf16")(key.data_ptr(), _rows("store_kv", key, "key"), value.data_ptr(),
                        _rows("store_kv", value, "value"), k_cache.data_ptr(), v_cache.data_ptr(),
                        slot_mapping.data_ptr(), t, g * d)
