"""W8A16 GEMM: 8-bit weights, one byte per value, row-major [N, K], with float scales per group of
G consecutive values of a row (G = K: one scale per output channel):

- `Q8_0`: int8 codes, float16 scales [N, K / 32] (GGUF's Q8_0 in the packed layout,
  docs/quantization.md; also what `quantization=int8` makes of a float checkpoint);
- `INT8`: int8 codes, scales [N, K / G] in any float dtype (per-channel: [N, 1]);
- `FP8`: float8 e4m3 codes (torch.float8_e4m3fn), scales float32 [N, 1] (per output channel) or
  per group; made at load by kernels/quant_group_reference.py `quantize_fp8`. Hopper and Ada
  (sm_89+) convert e4m3 in hardware; the kernel is compiled for sm_90 only.

w[n, k] = scales[n, k // G] * code. Per group, the codes are scaled in registers (float32), rounded
to x's dtype and fed to tl.dot. Per channel, the codes go to tl.dot as they are (int8 and e4m3
values are exact in float16 and bfloat16) and the [M, N] result is scaled once per column: fewer
instructions per weight byte, and exact where the group path rounds each scaled weight.

Oracle: kernels/quant_group_reference.py `dequantize_w8`.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu import quant_tiles as T
from kernels.gpu.launch import Launch

W8_QTYPES = {"Q8_0": torch.int8, "INT8": torch.int8, "FP8": torch.float8_e4m3fn}
FP8_MIN_ARCH = 89   # e4m3 conversions in hardware: Ada (8.9) and Hopper (9.0)


@triton.jit(do_not_specialize=["M"])
def _w8_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_PER_SPLIT, GROUP,
    stride_xm, stride_xk, stride_qw, stride_s, stride_om, stride_on,
    FP8: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n, k_start, k_end = T.program_tile(M, N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N)
    rows = offs_n.to(tl.int64)[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_end
        wmask = mask_n[:, None] & kmask[None, :]
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & kmask[None, :], other=0.0)
        q = tl.load(qw_ptr + rows * stride_qw + offs_k[None, :], mask=wmask, other=0)
        if FP8:  # e4m3 codes arrive as bytes: a masked lane's 0 is +0.0 (no integer casts to e4m3)
            q = q.to(tl.float8e4nv, bitcast=True)
        if PER_CHANNEL:
            w = q.to(x.dtype)
        else:
            s = tl.load(s_ptr + rows * stride_s + (offs_k // GROUP)[None, :], mask=wmask, other=0.0)
            w = (s.to(tl.float32) * q.to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if PER_CHANNEL:
        acc *= tl.load(s_ptr + offs_n.to(tl.int64) * stride_s, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    T.store_tile(acc, bias_ptr, out_ptr, part_ptr, M, N, offs_m, offs_n, stride_om, stride_on, HAS_BIAS)


def check_w8_weight(name: str, qtype: str, parts: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """qweight [N, K] and scales [N, K / G]; returns (N, K, G)."""
    if qtype not in W8_QTYPES:
        raise ValueError(f"{name}: no 8-bit kernel for {qtype!r}; it runs {', '.join(W8_QTYPES)}")
    for arg in ("qweight", "scales"):
        if arg not in parts:
            raise ValueError(f"{name}: a {qtype} matrix needs qweight and scales; missing {arg}")
    qw, scales = parts["qweight"], parts["scales"]
    C.check_ndim(name, "qweight", qw, 2, "[N, K]")
    C.check_ndim(name, "scales", scales, 2, "[N, K / group]")
    n, k = qw.shape
    groups = scales.shape[1]
    if groups < 1 or k % groups or (qtype == "Q8_0" and k != 32 * groups):
        need = "K / 32 columns" if qtype == "Q8_0" else "a column count dividing K"
        raise ValueError(f"{name}: {qtype} scales need {need} (K = {k}); got shape {tuple(scales.shape)}")
    T.check_array(name, "qweight", qw, (n, k), (W8_QTYPES[qtype],))
    T.check_array(name, "scales", scales, (n, groups),
                  (torch.float16,) if qtype == "Q8_0" else C.FLOAT_DTYPES)
    return n, k, k // groups


def w8_linear(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor],
              bias: Optional[torch.Tensor] = None, split_k: Optional[int] = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype; W 8-bit codes with group or channel scales."""
    return T.run(*w8_launches(x, qtype, parts, bias, split_k))


def w8_launches(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor], bias: Optional[torch.Tensor] = None,
                split_k: Optional[int] = None) -> tuple[torch.Tensor, list[Launch]]:
    """w8_linear's checks, its output (unwritten) and the launches that write it."""
    name = "w8_linear"
    n, k, _ = check_w8_weight(name, qtype, parts)
    tiles, out, partials = T.prepare(name, x, n, k, list(parts.values()), bias, split_k)
    if qtype == "FP8" and x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise ValueError(f"{name}: FP8 weights need compute capability 8.9 or newer (Ada, Hopper); "
                         f"this GPU has {torch.cuda.get_device_capability(x.device)}")
    return out, plan_w8_linear(x, qtype, parts, bias, out, partials, tiles) if x.shape[0] else []


def plan_w8_linear(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor], bias: Optional[torch.Tensor],
                   out: torch.Tensor, partials: Optional[torch.Tensor], tiles: T.Tiles) -> list[Launch]:
    """The launches w8_linear makes for checked arguments (kernels.aot compiles the same)."""
    m, n = out.shape
    qw, scales = parts["qweight"], parts["scales"]
    k = qw.shape[1]
    epilogue, has_bias = T.epilogue_args(bias, out, partials)
    main = Launch(
        _w8_gemm_kernel, tiles.grid(m, n),
        (x, qw.view(torch.uint8) if qtype == "FP8" else qw, scales, *epilogue, m, n, k, tiles.k_per_split, k // scales.shape[1],
         *x.stride(), qw.stride(0), scales.stride(0), *out.stride()),
        dict(FP8=qtype == "FP8", PER_CHANNEL=scales.shape[1] == 1, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
             BLOCK_K=tiles.block_k, HAS_BIAS=has_bias),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return T.launches(main, tiles, partials, bias, out)
