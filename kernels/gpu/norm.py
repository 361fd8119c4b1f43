"""Fused residual add + RMSNorm.

h = x + residual (rounded to x's dtype, as the torch reference adds in the model dtype), then
out = weight * h * rsqrt(mean(h^2) + eps) with fp32 statistics. Returns (out, h): h is the next
layer's residual. One program per row; the whole row (hidden size up to 64k) is one tile.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, eps,
    stride_xt, stride_xn, stride_rt, stride_rn, stride_w,
    stride_ot, stride_on, stride_ht, stride_hn,
    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_xt + offs * stride_xn, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rt + offs * stride_rn, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row * stride_ht + offs * stride_hn, h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, 0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + offs * stride_w, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + offs * stride_on, (w * (hf * rstd)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm. x [T, N]; weight [N]; residual [T, N] in x's dtype or None.
    Returns (rmsnorm(h) * weight, h) with h = x + residual (or x itself when residual is None)."""
    name = "rms_norm"
    C.check_ndim(name, "x", x, 2, "[tokens, hidden]")
    C.check_dtype(name, "x", x, C.FLOAT_DTYPES)
    C.check_dtype(name, "weight", weight, C.FLOAT_DTYPES)
    t, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"{name}: weight must have shape ({n},); got {tuple(weight.shape)}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"{name}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"{name}: residual dtype {residual.dtype} != x dtype {x.dtype}")
    if n > MAX_HIDDEN:
        raise ValueError(f"{name}: hidden size {n} exceeds the single-tile limit {MAX_HIDDEN}")
    if not eps >= 0.0:
        raise ValueError(f"{name}: eps must be >= 0; got {eps}")
    tensors = (x, weight) if residual is None else (x, weight, residual)
    C.check_device(name, *tensors)

    out = C.alloc((t, n), x.dtype, x.device)
    h = x if residual is None else C.alloc((t, n), x.dtype, x.device)
    if t == 0:
        return out, h
    plan_rms_norm(x, weight, eps, residual, out, h)()
    return out, h


def plan_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                  out: torch.Tensor, h: torch.Tensor) -> Launch:
    """The launch rms_norm makes for checked arguments (kernels.aot compiles the same)."""
    t, n = x.shape
    res = residual if residual is not None else x
    block_n = C.next_pow2(n)
    return Launch(
        _rms_norm_kernel, (t,),
        (x, res, weight, out, h, float(eps),
         *x.stride(), *res.stride(), weight.stride(0), *out.stride(), *h.stride()),
        dict(N=n, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None),
        num_warps=min(16, max(1, block_n // 512)),
    )
