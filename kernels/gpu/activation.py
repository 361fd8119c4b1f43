"""Gated activations of the MLP: x [T, 2I] = [gate | up] -> act(gate) * up, [T, I].

SiLU (Llama, Mistral, Qwen) and tanh-approximated GELU (Gemma's GeGLU, HF's "gelu_pytorch_tanh"):
one kernel, the activation a constexpr. fp32 math, one program per (row, BLOCK of columns).
GELU-tanh is written through the sigmoid: 0.5 * (1 + tanh(y)) = sigmoid(2y), so
gelu(g) = g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3)), with no tanh in the kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _gated_act_kernel(
    x_ptr, out_ptr,
    stride_xt, stride_xn, stride_ot, stride_on,
    INTER: tl.constexpr, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_xt + offs * stride_xn, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + (offs + INTER) * stride_xn, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        inner = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)   # 2 * sqrt(2 / pi) * (...)
        y = gate * tl.sigmoid(inner) * up
    else:
        y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_ot + offs * stride_on, y.to(out_ptr.dtype.element_ty), mask=mask)


def _gated(name: str, x: torch.Tensor, activation: str) -> torch.Tensor:
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
    plan_gated_activation(x, out, activation)()
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I] in x's dtype."""
    return _gated("silu_mul", x, "silu")


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] in x's dtype (Gemma's GeGLU)."""
    return _gated("gelu_tanh_mul", x, "gelu_tanh")


def plan_gated_activation(x: torch.Tensor, out: torch.Tensor, activation: str = "silu") -> Launch:
    """The launch silu_mul / gelu_tanh_mul make for checked arguments (kernels.aot compiles the same)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    t, inter = out.shape
    block = min(1024, C.next_pow2(inter))
    return Launch(_gated_act_kernel, (t, C.cdiv(inter, block)), (x, out, *x.stride(), *out.stride()),
                  dict(INTER=inter, BLOCK=block, GELU_TANH=activation == "gelu_tanh"), num_warps=4)
