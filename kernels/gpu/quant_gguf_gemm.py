"""W4A16-family GEMM on GGUF weights in the packed layout (docs/quantization.md): Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K, read as the importer writes them (no re-layout at load).

out[M, N] = x[M, K] @ W.T (+ bias), W[n, k] the layout's value table, computed in float32 from the
codes and scales in registers, one [BLOCK_N, BLOCK_K] tile at a time, rounded to x's dtype and fed
to tl.dot (float32 accumulation). The layout puts values 0..15 of a 32-value group in the low
nibbles of 16 bytes and values 16..31 in the high nibbles, so a tile of BLOCK_K / 2 bytes per row
is two half-tiles: the low nibbles against x at k = 32 g + i, the high ones against x at
k = 32 g + 16 + i (i < 16). Each byte is read once, and so is each group's scale (and min, sub-scale),
spread over the group's lanes in registers. Q5 and Q6_K add bit planes (`qhigh`): bit i of a group's
little-endian uint32 is bit 4 (bit 5) of value i: the two bytes of a half-group's 16 lanes are read
once and their bits spread. (Before, every lane loaded its own scale and bit byte: on the first H200,
2026-12-04, the decode GEMMs ran at 1-4% of their bandwidth floor.)

Oracle: kernels/quant_reference.py `dequantize` (ggml's floats, bit for bit).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu import quant_tiles as T
from kernels.gpu.launch import Launch
from kernels.quant_reference import ARRAYS, QK, QK_K

# The codes of QTYPE (constexpr) in the kernel.
QTYPES = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


@triton.jit
def _lanes(v, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """[BLOCK_N, G] per-group values -> [BLOCK_N, G * 16]: each group's value for its 16 lanes."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, G, 16)), (BLOCK_N, G * 16))


@triton.jit
def _high_bits(qh_ptr, row_off, first, gmask, BLOCK_N: tl.constexpr, G: tl.constexpr):
    """Bit i % 8 of byte `first` + i // 8 of each group's bit plane, for lanes i < 16 ([BLOCK_N,
    G * 16] of 0/1, int32): the two bytes a half-group's 16 lanes share, read once and spread."""
    two = tl.arange(0, 2)
    b = tl.load(qh_ptr + row_off[:, :, None] + (first[:, None] + two[None, :])[None, :, :],
                mask=gmask[:, :, None], other=0).to(tl.int32)                     # [BLOCK_N, G, 2]
    bits = (b[:, :, :, None] >> tl.arange(0, 8)[None, None, None, :]) & 1        # [BLOCK_N, G, 2, 8]
    return tl.reshape(bits, (BLOCK_N, G * 16))


# The strides of the per-group arrays are not specialized either: the K-quants' rows of K / 256
# scales would otherwise split one configuration into two binaries by whether K / 256 is a multiple
# of 16. Per-group values are read once a group ([BLOCK_N, G]) and spread over its lanes in registers.
@triton.jit(do_not_specialize=["M", "stride_qh", "stride_d", "stride_dm", "stride_sc", "stride_sm"])
def _gguf_gemm_kernel(
    x_ptr, qw_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, sm_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_qw, stride_qh, stride_d, stride_dm, stride_sc, stride_sm,
    stride_om, stride_on,
    QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 32                 # groups of 32 values in a K tile
    FIVE_BITS: tl.constexpr = (QTYPE == 2) or (QTYPE == 3) or (QTYPE == 5)
    K_QUANT: tl.constexpr = QTYPE >= 4
    offs_m, offs_n, mask_m, mask_n, k_start, k_end = T.program_tile(M, N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N)
    rows = offs_n.to(tl.int64)[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    j = tl.arange(0, HALF)          # byte of the tile's row = (group, lane i)
    lane = j % 16
    g = tl.arange(0, G)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_lo = k0 + (j // 16) * 32 + lane          # the low nibble's value; the high one is k_lo + 16
        kmask = k_lo < k_end                        # K and k_end are multiples of 32
        wmask = mask_n[:, None] & kmask[None, :]
        group = k0 // 32 + g                        # the tile's groups
        gmask = mask_n[:, None] & (group < k_end // 32)[None, :]
        b = tl.load(qw_ptr + rows * stride_qw + (k0 // 2 + j)[None, :], mask=wmask, other=0).to(tl.int32)
        q_lo, q_hi = b & 15, b >> 4
        if FIVE_BITS:
            qh = rows * stride_qh
            q_lo |= _high_bits(qh_ptr, qh, group * 4, gmask, BLOCK_N, G) << 4
            q_hi |= _high_bits(qh_ptr, qh, group * 4 + 2, gmask, BLOCK_N, G) << 4
        if QTYPE == 6:  # Q6_K: two planes per group, bit 4 then bit 5
            qh = rows * stride_qh
            q_lo |= _high_bits(qh_ptr, qh, group * 8, gmask, BLOCK_N, G) << 4
            q_hi |= _high_bits(qh_ptr, qh, group * 8 + 2, gmask, BLOCK_N, G) << 4
            q_lo |= _high_bits(qh_ptr, qh, group * 8 + 4, gmask, BLOCK_N, G) << 5
            q_hi |= _high_bits(qh_ptr, qh, group * 8 + 6, gmask, BLOCK_N, G) << 5
        if K_QUANT:   # one super-block of 256 per tile (BLOCK_K divides 256): its scale for every lane
            d = tl.load(d_ptr + rows * stride_d + k0 // 256, mask=mask_n[:, None], other=0.0).to(tl.float32)
        else:
            d = tl.load(d_ptr + rows * stride_d + group[None, :], mask=gmask, other=0.0).to(tl.float32)
        # the value table of docs/quantization.md, in its float32 operation order
        if QTYPE == 0 or QTYPE == 2:
            zero = 8.0 if QTYPE == 0 else 16.0
            d = _lanes(d, BLOCK_N, G)
            w_lo = d * (q_lo.to(tl.float32) - zero)
            w_hi = d * (q_hi.to(tl.float32) - zero)
        elif QTYPE == 1 or QTYPE == 3:
            mn = _lanes(tl.load(dm_ptr + rows * stride_dm + group[None, :], mask=gmask, other=0.0).to(tl.float32),
                        BLOCK_N, G)
            d = _lanes(d, BLOCK_N, G)
            w_lo = d * q_lo.to(tl.float32) + mn
            w_hi = d * q_hi.to(tl.float32) + mn
        elif QTYPE == 6:
            sc = sc_ptr + rows * stride_sc + (group * 2)[None, :]
            s_lo = _lanes(d * tl.load(sc, mask=gmask, other=0).to(tl.float32), BLOCK_N, G)
            s_hi = _lanes(d * tl.load(sc + 1, mask=gmask, other=0).to(tl.float32), BLOCK_N, G)
            w_lo = s_lo * (q_lo.to(tl.float32) - 32.0)
            w_hi = s_hi * (q_hi.to(tl.float32) - 32.0)
        else:  # Q4_K, Q5_K
            scale = _lanes(d * tl.load(sc_ptr + rows * stride_sc + group[None, :], mask=gmask, other=0).to(tl.float32),
                           BLOCK_N, G)
            dmin = tl.load(dm_ptr + rows * stride_dm + k0 // 256, mask=mask_n[:, None], other=0.0).to(tl.float32)
            mn = _lanes(dmin * tl.load(sm_ptr + rows * stride_sm + group[None, :], mask=gmask, other=0).to(tl.float32),
                        BLOCK_N, G)
            w_lo = scale * q_lo.to(tl.float32) + mn
            w_hi = scale * q_hi.to(tl.float32) + mn
        xmask = mask_m[:, None] & kmask[None, :]
        x_lo = tl.load(x_rows + k_lo[None, :] * stride_xk, mask=xmask, other=0.0)
        x_hi = tl.load(x_rows + (k_lo + 16)[None, :] * stride_xk, mask=xmask, other=0.0)
        acc += tl.dot(x_lo, tl.trans(w_lo.to(x_lo.dtype)), input_precision="ieee")
        acc += tl.dot(x_hi, tl.trans(w_hi.to(x_hi.dtype)), input_precision="ieee")
    T.store_tile(acc, bias_ptr, out_ptr, part_ptr, M, N, offs_m, offs_n, stride_om, stride_on, HAS_BIAS)


def check_gguf_weight(name: str, qtype: str, parts: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """The packed arrays of one matrix, against docs/quantization.md; returns (N, K)."""
    if qtype not in QTYPES:
        raise ValueError(f"{name}: no GGUF kernel for {qtype!r}; it runs {', '.join(QTYPES)}")
    missing = [a for a in ARRAYS[qtype] if a not in parts]
    if missing:
        raise ValueError(f"{name}: a {qtype} matrix needs {', '.join(ARRAYS[qtype])}; missing {', '.join(missing)}")
    qw = parts["qweight"]
    C.check_ndim(name, "qweight", qw, 2, "[N, K / 2] uint8")
    n, k = qw.shape[0], qw.shape[1] * 2
    block = QK_K if qtype in K_QUANTS else QK
    if k % block:
        raise ValueError(f"{name}: {qtype} needs K a multiple of {block}; qweight gives K = {k}")
    T.check_array(name, "qweight", qw, (n, k // 2), (torch.uint8,))
    wide = k // QK_K if qtype in K_QUANTS else k // QK
    T.check_array(name, "scales", parts["scales"], (n, wide), (torch.float16,))
    if "mins" in ARRAYS[qtype]:
        T.check_array(name, "mins", parts["mins"], (n, wide), (torch.float16,))
    if "qhigh" in ARRAYS[qtype]:
        T.check_array(name, "qhigh", parts["qhigh"], (n, k // (4 if qtype == "Q6_K" else 8)), (torch.uint8,))
    if qtype == "Q6_K":
        T.check_array(name, "sub_scales", parts["sub_scales"], (n, k // 16), (torch.int8,))
    elif qtype in K_QUANTS:
        T.check_array(name, "sub_scales", parts["sub_scales"], (n, k // QK), (torch.uint8,))
        T.check_array(name, "sub_mins", parts["sub_mins"], (n, k // QK), (torch.uint8,))
    return n, k


def gguf_linear(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor],
                bias: Optional[torch.Tensor] = None, split_k: Optional[int] = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype; W a packed GGUF matrix (docs/quantization.md)."""
    return T.run(*gguf_launches(x, qtype, parts, bias, split_k))


def gguf_launches(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor], bias: Optional[torch.Tensor] = None,
                  split_k: Optional[int] = None) -> tuple[torch.Tensor, list[Launch]]:
    """gguf_linear's checks, its output (unwritten) and the launches that write it."""
    n, k = check_gguf_weight("gguf_linear", qtype, parts)
    tiles, out, partials = T.prepare("gguf_linear", x, n, k, list(parts.values()), bias, split_k)
    return out, plan_gguf_linear(x, qtype, parts, bias, out, partials, tiles) if x.shape[0] else []


def plan_gguf_linear(x: torch.Tensor, qtype: str, parts: Mapping[str, torch.Tensor], bias: Optional[torch.Tensor],
                     out: torch.Tensor, partials: Optional[torch.Tensor], tiles: T.Tiles) -> list[Launch]:
    """The launches gguf_linear makes for checked arguments (kernels.aot compiles the same)."""
    m, n = out.shape
    k = parts["qweight"].shape[1] * 2
    qw = parts["qweight"]
    arrays = [parts.get(a, qw) for a in ("qhigh", "scales", "mins", "sub_scales", "sub_mins")]
    epilogue, has_bias = T.epilogue_args(bias, out, partials)
    main = Launch(
        _gguf_gemm_kernel, tiles.grid(m, n),
        (x, qw, *arrays, *epilogue, m, n, k, tiles.k_per_split,
         *x.stride(), qw.stride(0), *(a.stride(0) for a in arrays), *out.stride()),
        dict(QTYPE=QTYPES[qtype], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
             HAS_BIAS=has_bias),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return T.launches(main, tiles, partials, bias, out)
