"""W4A16 GEMM on AWQ checkpoints: int4 codes packed eight to an int32 along the output dimension,
with a float16 scale and a 4-bit zero point per group of G input rows (G = 128 typically), as
AutoAWQ's GEMM format stores them and vLLM's `awq` method loads them (docs/quantization.md, "AWQ"):

- `qweight` int32 [K, N / 8]: nibble j (bits 4 j .. 4 j + 3) of column c holds output 8 c + ORDER[j],
  ORDER = (0, 2, 4, 6, 1, 3, 5, 7); so output n sits at shift 4 * (n % 2 * 4 + n % 8 // 2);
- `qzeros` int32 [K / G, N / 8], packed the same way; `scales` float16 [K / G, N];
- w[k, n] = (q[k, n] - z[k // G, n]) * scales[k // G, n] (W is [K, N] here, not [N, K]).

A tile of [BLOCK_K, BLOCK_N] codes is unpacked and scaled in registers (float32), rounded to x's
dtype and fed to tl.dot. Each int32 is read by the eight lanes of its outputs (the same address:
one transaction). Oracle: kernels/quant_group_reference.py `dequantize_awq`.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu import quant_tiles as T
from kernels.gpu.launch import Launch

PACK = 8   # int4 codes per int32


@triton.jit
def _spread(packed, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[ROWS, BLOCK_N / 8] int32 -> [ROWS, BLOCK_N]: each int32 repeated for its eight outputs, in
    registers (loading it once per output would make the pipeliner stage eight copies)."""
    return tl.reshape(tl.broadcast_to(packed[:, :, None], (ROWS, BLOCK_N // 8, 8)), (ROWS, BLOCK_N))


@triton.jit(do_not_specialize=["M"])
def _awq_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_PER_SPLIT, GROUP,
    stride_xm, stride_xk, stride_qw, stride_qz, stride_s, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    offs_m, offs_n, mask_m, mask_n, k_start, k_end = T.program_tile(M, N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N)
    cols = tl.program_id(0) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)     # the int32 columns of the tile
    mask_c = cols < N // 8
    shift = ((offs_n % 2) * 4 + (offs_n % 8) // 2) * 4
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        # BLOCK_K divides GROUP (awq_launches): the tile's rows share one group's zeros and scales
        group = (k0 // GROUP).to(tl.int64)
        z = tl.load(qz_ptr + group * stride_qz + cols, mask=mask_c, other=0)
        z = (tl.reshape(tl.broadcast_to(z[:, None], (BLOCK_N // 8, 8)), (BLOCK_N,)) >> shift) & 15
        s = tl.load(s_ptr + group * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_end
        p = tl.load(qw_ptr + offs_k.to(tl.int64)[:, None] * stride_qw + cols[None, :],
                    mask=kmask[:, None] & mask_c[None, :], other=0)
        q = (_spread(p, BLOCK_K, BLOCK_N) >> shift[None, :]) & 15
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & kmask[None, :], other=0.0)
        w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision="ieee")
    T.store_tile(acc, bias_ptr, out_ptr, part_ptr, M, N, offs_m, offs_n, stride_om, stride_on, HAS_BIAS)


def check_awq_weight(name: str, parts: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """qweight [K, N / 8] int32, qzeros [K / G, N / 8] int32, scales [K / G, N]; returns (N, K, G)."""
    for arg in ("qweight", "qzeros", "scales"):
        if arg not in parts:
            raise ValueError(f"{name}: an AWQ matrix needs qweight, qzeros and scales; missing {arg}")
    qw, scales = parts["qweight"], parts["scales"]
    C.check_ndim(name, "qweight", qw, 2, "[K, N / 8] int32")
    C.check_ndim(name, "scales", scales, 2, "[K / group, N]")
    k, n = qw.shape[0], qw.shape[1] * PACK
    groups = scales.shape[0]
    if groups < 1 or k % groups:
        raise ValueError(f"{name}: AWQ scales need a row count dividing K = {k}; got shape {tuple(scales.shape)}")
    if (k // groups) % 16:
        raise ValueError(f"{name}: the AWQ group size must be a multiple of 16 (32, 64, 128 or K); got {k // groups}")
    T.check_array(name, "qweight", qw, (k, n // PACK), (torch.int32,))
    T.check_array(name, "qzeros", parts["qzeros"], (groups, n // PACK), (torch.int32,))
    T.check_array(name, "scales", scales, (groups, n), (torch.float16, torch.bfloat16))
    return n, k, k // groups


def awq_linear(x: torch.Tensor, parts: Mapping[str, torch.Tensor], bias: Optional[torch.Tensor] = None,
               split_k: Optional[int] = None) -> torch.Tensor:
    """x [M, K] @ W (+ bias) -> [M, N] in x's dtype; W an AWQ-packed [K, N] matrix."""
    return T.run(*awq_launches(x, parts, bias, split_k))


def awq_launches(x: torch.Tensor, parts: Mapping[str, torch.Tensor], bias: Optional[torch.Tensor] = None,
                 split_k: Optional[int] = None) -> tuple[torch.Tensor, list[Launch]]:
    """awq_linear's checks, its output (unwritten) and the launches that write it."""
    n, k, group = check_awq_weight("awq_linear", parts)
    tiles, out, partials = T.prepare("awq_linear", x, n, k, list(parts.values()), bias, split_k, group)
    return out, plan_awq_linear(x, parts, bias, out, partials, tiles) if x.shape[0] else []


def plan_awq_linear(x: torch.Tensor, parts: Mapping[str, torch.Tensor], bias: Optional[torch.Tensor],
                    out: torch.Tensor, partials: Optional[torch.Tensor], tiles: T.Tiles) -> list[Launch]:
    """The launches awq_linear makes for checked arguments (kernels.aot compiles the same)."""
    m, n = out.shape
    qw, qz, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, group = qw.shape[0], qw.shape[0] // scales.shape[0]
    if group % tiles.block_k:
        raise ValueError(f"awq_linear: K tiles of {tiles.block_k} straddle groups of {group} (plan_tiles(k_group=))")
    epilogue, has_bias = T.epilogue_args(bias, out, partials)
    main = Launch(
        _awq_gemm_kernel, tiles.grid(m, n),
        (x, qw, qz, scales, *epilogue, m, n, k, tiles.k_per_split,
         group, *x.stride(), qw.stride(0), qz.stride(0), scales.stride(0), *out.stride()),
        dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
             HAS_BIAS=has_bias),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return T.launches(main, tiles, partials, bias, out)
