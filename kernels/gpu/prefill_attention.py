"""Prefill (context) attention: causal, variable-length packed query chunks over the paged cache.

Sequence i's queries are rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q, at positions
seq_lens[i] - q_len .. seq_lens[i] - 1; its keys/values (the chunk's own already stored, plus any
earlier chunk or reused prefix) are read from the paged cache through its block table. So one
kernel serves plain prefill, chunked prefill and prefix reuse.

Design (flash-attention 2 forward):
- One program per (query tile of BLOCK_M rows, sequence, query head); GQA by mapping the query
  head to its kv head (the other heads of the group hit the same K/V in L2).
- Online softmax in the exp2 domain, fp32 accumulators, `tl.dot` for QK^T and PV.
- The kv loop runs in two phases: tiles that lie wholly before the tile's first query position
  need no causal or length mask; only the tiles on the diagonal are masked (-inf).
- K/V tokens are gathered through the block table per token, so any cache block size works.
- Sliding window (a local layer, `window` > 0; SLIDING is its compiled variant): a query sees keys
  q - window < k <= q. The kv loop starts at the tile holding the first row's first visible key,
  so tiles that no row of the query tile can see are never read, and a third phase masks the
  window's left edge (the tiles that only some rows see); between it and the diagonal nothing is
  masked, as without a window.

The grid's first dimension must cover the longest chunk. Pass `max_q_len` when the caller knows it
(the engine does); otherwise the wrapper uses it from cu_seqlens_q when that lives on the CPU, or
the total token count (a safe bound; surplus programs exit at once) rather than sync the device.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_ptrs, v_ptrs, kv_mask, scores_mask, scale_log2,
                 MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One kv tile of the online softmax. k_ptrs/v_ptrs [BLOCK_N, BLOCK_D]."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # an fp8 cache is read in q's dtype
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * scale_log2
    if MASKED:
        qk = tl.where(scores_mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bts", "stride_btb", "window"])   # the table's width changes per step
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, seq_lens_ptr, out_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    QUERY_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SLIDING: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)

    q_begin = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32) - q_begin
    if tile_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_len = seq_len - q_len                      # cached tokens before this chunk
    kvh = head // QUERY_GROUP

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = ctx_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_cache_ptr + kvh * stride_kh + offs_d[None, :] * stride_kd
    v_base = v_cache_ptr + kvh * stride_vh + offs_d[None, :] * stride_vd

    first_pos = ctx_len + tile_m * BLOCK_M          # < seq_len since this tile has a query
    diag_start = (first_pos // BLOCK_N) * BLOCK_N   # keys below this are past for every row
    kv_end = tl.minimum(first_pos + BLOCK_M, seq_len)

    full_start = 0                                  # keys from here to diag_start: seen by every row
    if SLIDING:
        # Phase 0: the window's left edge. No row sees a key before the first row's window (those
        # tiles are skipped); a key at kv_end - window or later is in every row's window.
        # Positions before the first row's window are not even loaded: their blocks may have been
        # freed and handed to another sequence (the cache keeps only a local layer's window).
        seen = tl.maximum(first_pos - window + 1, 0)
        lo = (seen // BLOCK_N) * BLOCK_N
        full_start = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N, lo),
                                diag_start)
        for n0 in range(lo, full_start, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos >= seen
            blk = tl.load(table + (pos // BLOCK_SIZE) * stride_btb, mask=mask_n, other=0).to(tl.int64)
            row = (pos % BLOCK_SIZE).to(tl.int64)
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i,
                k_base + (blk * stride_kb + row * stride_ko)[:, None],
                v_base + (blk * stride_vb + row * stride_vo)[:, None],
                mask_n[:, None] & mask_d[None, :], pos[None, :] > q_pos[:, None] - window,
                scale_log2, MASKED=True, IEEE=IEEE)

    # Phase 1: whole tiles before the diagonal, no masks on the kv positions.
    for n0 in range(full_start, diag_start, BLOCK_N):
        pos = n0 + offs_n
        blk = tl.load(table + (pos // BLOCK_SIZE) * stride_btb).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i,
            k_base + (blk * stride_kb + row * stride_ko)[:, None],
            v_base + (blk * stride_vb + row * stride_vo)[:, None],
            mask_d[None, :], mask_d[None, :], scale_log2, MASKED=False, IEEE=IEEE)  # scores mask unused

    # Phase 2: the diagonal tiles, causal and length masks (and the window's, for short windows).
    for n0 in range(diag_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < kv_end
        if SLIDING:
            mask_n = mask_n & (pos >= seen)
        blk = tl.load(table + (pos // BLOCK_SIZE) * stride_btb, mask=mask_n, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i,
            k_base + (blk * stride_kb + row * stride_ko)[:, None],
            v_base + (blk * stride_vb + row * stride_vo)[:, None],
            mask_n[:, None] & mask_d[None, :], visible, scale_log2, MASKED=True, IEEE=IEEE)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _default_blocks(dtype: torch.dtype, head_dim: int, interpreted: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). fp32 tiles are halved to fit shared memory."""
    if interpreted:
        return 32, 32, 4, 1            # the interpreter: small tiles waste less on short chunks
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 3


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, *, max_q_len: Optional[int] = None, window: int = 0,
                      block_m: Optional[int] = None, block_n: Optional[int] = None) -> torch.Tensor:
    """Causal attention for packed query chunks that read the paged cache.

    q [T, H, D]: S sequences back to back, sequence i at rows cu_seqlens_q[i]:cu_seqlens_q[i+1]
    (cu_seqlens_q [S+1], int32/int64, starting at 0). seq_lens[i] counts all cached tokens of
    sequence i, the chunk's own included (already stored). window > 0: each query sees only its
    last `window` positions (a sliding-window layer). Returns [T, H, D] in q's dtype.

    Keyword-only: max_q_len (the longest chunk, sizes the grid), block_m/block_n (tile sizes,
    powers of two >= 16).
    """
    name = "prefill_attention"
    C.check_paged_attention(name, q, "[tokens, num_heads, head_dim]", k_cache, v_cache, block_tables,
                            seq_lens, scale, window=window)
    C.check_dtype(name, "cu_seqlens_q", cu_seqlens_q, C.INDEX_DTYPES)
    t, h, d = q.shape
    if seq_lens.dim() != 1:
        raise ValueError(f"{name}: seq_lens must be 1-D [num_seqs]; got shape {tuple(seq_lens.shape)}")
    s = seq_lens.shape[0]
    if cu_seqlens_q.shape != (s + 1,):
        raise ValueError(f"{name}: cu_seqlens_q must have shape ({s + 1},) for {s} sequences; "
                         f"got {tuple(cu_seqlens_q.shape)}")
    if block_tables.shape[0] != s:
        raise ValueError(f"{name}: block_tables has {block_tables.shape[0]} rows for {s} sequences")
    for arg, tensor in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if tensor.shape[0] > 1 and tensor.stride(0) != 1:
            raise ValueError(f"{name}: {arg} must be contiguous")
    C.check_device(name, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)

    out = C.alloc((t, h, d), q.dtype, q.device)
    if t == 0 or s == 0:
        return out
    for arg, v in (("block_m", block_m), ("block_n", block_n)):
        if v is not None and (v < 16 or v & (v - 1)):
            raise ValueError(f"{name}: {arg} must be a power of two >= 16; got {v}")
    if max_q_len is None:
        if cu_seqlens_q.device.type == "cpu":
            max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        else:
            max_q_len = t
    if max_q_len <= 0:
        return out
    plan_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out,
                           max_q_len, window=window, block_m=block_m, block_n=block_n)()
    return out


def plan_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, out: torch.Tensor, max_q_len: int, *, window: int = 0,
                           on_gpu: bool = False, block_m: Optional[int] = None,
                           block_n: Optional[int] = None) -> Launch:
    """The launch prefill_attention makes for checked arguments (kernels.aot compiles the same, with
    on_gpu=True). The tiles are the GPU's wherever the kernel is compiled for one, whatever device
    the tensors are on; the interpreter's only where the kernel is interpreted."""
    d, h, g = q.shape[2], q.shape[1], k_cache.shape[2]
    interpreted = not on_gpu and type(_prefill_attention_kernel).__name__ == "InterpretedFunction"
    bm, bn, num_warps, num_stages = _default_blocks(q.dtype, d, interpreted)
    bm, bn = block_m or bm, block_n or bn
    return Launch(
        _prefill_attention_kernel, (C.cdiv(max_q_len, bm), seq_lens.shape[0], h),
        (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
         float(scale) * LOG2E, window,
         *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride()),
        dict(QUERY_GROUP=h // g, HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[1],
             BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(16, C.next_pow2(d)), SLIDING=window > 0,
             IEEE=q.dtype == torch.float32),
        num_warps=num_warps, num_stages=num_stages,
    )
