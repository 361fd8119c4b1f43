"""SiLU-and-multiply for the gated MLP: x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I].

fp32 math (silu(g) = g * sigmoid(g)), one program per (row, BLOCK of columns).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _common as C
from kernels.launch import Launch


@triton.jit
def _silu_mul_kernel(
    x_ptr, out_ptr,
    stride_xt, stride_xn, stride_ot, stride_on,
    INTER: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_xt + offs * stride_xn, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + (offs + INTER) * stride_xn, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_ot + offs * stride_on, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I] in x's dtype."""
    name = "silu_mul"
    C.check_ndim(name, "x", x, 2, "[tokens, 2 * intermediate]")
    C.check_dtype(name, "x", x, C.FLOAT_DTYPES)
    t, n2 = x.shape
    if n2 % 2:
        raise ValueError(f"{name}: the last dim of x must be even ([gate | up]); got {n2}")
    C.check_device(name, x)
    inter = n2 // 2
    out = C.alloc((t, inter), x.dtype, x.device)
    if t == 0 or inter == 0:
        return out
    plan_silu_mul(x, out)()
    return out


def plan_silu_mul(x: torch.Tensor, out: torch.Tensor) -> Launch:
    """The launch silu_mul makes for checked arguments (kernels.aot compiles the same)."""
    t, inter = out.shape
    block = min(1024, C.next_pow2(inter))
    return Launch(_silu_mul_kernel, (t, C.cdiv(inter, block)), (x, out, *x.stride(), *out.stride()),
                  dict(INTER=inter, BLOCK=block), num_warps=4)
