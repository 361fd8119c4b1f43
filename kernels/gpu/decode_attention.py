"""Paged decode attention: one query token per sequence against its paged KV cache.

Design (flash-decoding):
- One program per (sequence, kv head, split). It handles all QUERY_GROUP query heads that share
  the kv head (GQA), so each K/V byte is read from memory once per split, not once per query head.
  The query heads are padded to BLOCK_H >= 16 rows so the scores and the P@V product run on
  `tl.dot` (tensor cores); the padded rows are masked on load and store.
- The kv positions are walked in tiles of BLOCK_N tokens (64 by default). Each token of a tile is
  gathered through the block table (block = table[pos // BLOCK_SIZE], row = pos % BLOCK_SIZE), so
  any cache block size works (1, 16, 32, ...), and each token's head_dim row is one contiguous,
  vectorized load.
- Online softmax in the exp2 domain (scale folded with log2(e)), positions past the split's end
  masked to -inf.
- Split-K: when batch * kv_heads programs cannot fill the GPU, each sequence's context is cut into
  num_splits ranges (tile-aligned, sized per sequence), each split writes its normalised partial
  output and log-sum-exp, and a second small kernel merges them. With one split the first kernel
  writes the output directly and the merge is skipped.
- Compiled variants: Triton specializes an integer argument that equals 1 or is divisible by 16
  unless told not to, so the values that change from step to step (the split count, the strides
  of the partials and of the block table) are marked `do_not_specialize`, and the merge kernel
  always spans MAX_SPLITS partials (masked). Decode attention is then two variants per model and
  dtype (one pass, split-K) plus one merge, whatever the batch: the engine's warm-up compiles
  them all, and `python -m kernels.aot` checks the same set.
- A sequence of length 0 produces zeros (the torch reference produces NaN for it).
- Sliding window (a local layer, `window` > 0; SLIDING is its compiled variant): a sequence's
  context starts at seq_len - window, so the splits divide the window and the blocks before it are
  never read, not merely masked.

The wrapper never syncs with the device (no `.item()`), so it can be captured in a CUDA graph; the
split count comes from the shapes only (block_tables width * block_size bounds the context).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kernels import checks as C
from kernels.gpu.launch import Launch

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 128   # below this a split's fixed cost (partials, merge) outweighs its work
MAX_SPLITS = 64
DEFAULT_BLOCK_N = 64         # kv positions per tile: the K of the P@V tl.dot, so >= 16 on the GPU


_STEP_VARYING = ["stride_bts", "stride_btb", "stride_ps", "stride_ph", "stride_pk", "stride_pd",
                 "stride_ls", "stride_lh", "stride_lk", "num_splits", "window"]


@triton.jit(do_not_specialize=_STEP_VARYING)
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    scale_log2,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pk, stride_pd,
    stride_ls, stride_lh, stride_lk,
    num_splits, window,
    QUERY_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SLIDING: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first = 0                                      # the first position the query sees
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < QUERY_GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * QUERY_GROUP + offs_h

    q = tl.load(q_ptr + seq64 * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    table = block_tables_ptr + seq64 * stride_bts
    k_base = k_cache_ptr + kvh * stride_kh + offs_d[None, :] * stride_kd
    v_base = v_cache_ptr + kvh * stride_vh + offs_d[None, :] * stride_vd
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        blk = tl.load(table + (pos // BLOCK_SIZE) * stride_btb, mask=mask_n, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # an fp8 cache (kv_cache_dtype=fp8) is read in q's dtype: the dots stay bf16/fp16 ones
        k = tl.load(k_base + (blk * stride_kb + row * stride_ko)[:, None], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(mask_n[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))       # finite: every tile has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (blk * stride_vb + row * stride_vo)[:, None], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0.0                                   # false for an empty split or sequence
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    out_mask = mask_h[:, None] & mask_d[None, :]
    if not SPLIT:
        tl.store(out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_o_ptr + seq64 * stride_ps + heads[:, None] * stride_ph + split * stride_pk
                 + offs_d[None, :] * stride_pd, o, mask=out_mask)
        tl.store(part_lse_ptr + seq64 * stride_ls + heads * stride_lh + split * stride_lk, lse, mask=mask_h)


@triton.jit(do_not_specialize=_STEP_VARYING[2:-1])
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_ps, stride_ph, stride_pk, stride_pd,
    stride_ls, stride_lh, stride_lk,
    stride_os, stride_oh, stride_od,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_k = offs_k < num_splits
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + offs_k * stride_lk,
                  mask=mask_k, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)          # all splits empty: weights become 0
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + seq * stride_ps + head * stride_ph + offs_k[:, None] * stride_pk
                + offs_d[None, :] * stride_pd, mask=mask_k[:, None] & mask_d[None, :], other=0.0)
    den = tl.sum(w, 0)
    num = tl.sum(w[:, None] * o, 0)
    res = num / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=mask_d)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K factor: 1 when batch * kv_heads programs already give every SM two or more programs
    (enough to overlap one program's memory latency with another's loads, and the tail of the last
    wave is small); otherwise enough splits to reach ~4 programs per SM, with at least
    MIN_TOKENS_PER_SPLIT tokens per split and at most MAX_SPLITS."""
    programs = max(1, batch * num_kv_heads)
    if programs >= 2 * num_sms:
        return 1
    target = 4 * num_sms
    by_len = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(C.cdiv(target, programs), by_len, MAX_SPLITS))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                     num_splits: Optional[int] = None, max_seq_len: Optional[int] = None,
                     block_n: Optional[int] = None, window: int = 0) -> torch.Tensor:
    """One query token per sequence. q [S, H, D]; k/v_cache [NB, BS, G, D]; block_tables [S, MB]
    int32/int64; seq_lens [S] = cached tokens to attend to (the query's own K/V already stored).
    window > 0: each query sees only the last `window` of them (a sliding-window layer).
    Returns [S, H, D] in q's dtype.

    Keyword-only tuning knobs (the defaults are what the engine uses):
      num_splits: force the split-K factor (1 = single pass, no merge kernel).
      max_seq_len: an upper bound of seq_lens for the split heuristic (default: MB * BS).
      block_n: kv positions per tile (a power of two >= 16).
    """
    name = "decode_attention"
    C.check_paged_attention(name, q, "[num_seqs, num_heads, head_dim]", k_cache, v_cache, block_tables,
                            seq_lens, scale, window=window)
    s, h, d = q.shape
    nb, bs, g, _ = k_cache.shape
    if block_tables.shape[0] != s:
        raise ValueError(f"{name}: block_tables has {block_tables.shape[0]} rows for {s} sequences")
    if seq_lens.shape != (s,):
        raise ValueError(f"{name}: seq_lens must have shape ({s},); got {tuple(seq_lens.shape)}")
    if s > 1 and seq_lens.stride(0) != 1:
        raise ValueError(f"{name}: seq_lens must be contiguous")
    C.check_device(name, q, k_cache, v_cache, block_tables, seq_lens)

    out = C.alloc((s, h, d), q.dtype, q.device)
    if s == 0:
        return out
    block_n = block_n or DEFAULT_BLOCK_N
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{name}: block_n must be a power of two >= 16; got {block_n}")
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * bs
        num_splits = choose_num_splits(s, g, min(bound, window) if window else bound, C.num_sms(q.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{name}: num_splits must be in [1, {MAX_SPLITS}]; got {num_splits}")

    for launch in plan_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                                        num_splits, block_n, window):
        launch()
    return out


def plan_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                          out: torch.Tensor, num_splits: int, block_n: int, window: int = 0) -> list[Launch]:
    """The launches decode_attention makes for checked arguments: the attention kernel, then the
    merge kernel when num_splits > 1 (kernels.aot compiles the same). Allocates the partials."""
    s, h, d = q.shape
    g, bs = k_cache.shape[2], k_cache.shape[1]
    qg = h // g
    block_d = max(16, C.next_pow2(d))
    block_h = max(16, C.next_pow2(qg))
    if num_splits > 1:
        part_o = C.alloc((s, h, num_splits, d), torch.float32, q.device)
        part_lse = C.alloc((s, h, num_splits), torch.float32, q.device)
    else:  # unused by the kernel; any tensor stands in for the pointers
        part_o = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        part_lse = out.new_empty((1, 1, 1), dtype=torch.float32)
    launches = [Launch(
        _decode_attention_kernel, (s, g, num_splits),
        (q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
         float(scale) * LOG2E,
         *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
         *part_o.stride(), *part_lse.stride(),
         num_splits, window),
        dict(QUERY_GROUP=qg, HEAD_DIM=d, BLOCK_SIZE=bs,
             BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n,
             SPLIT=num_splits > 1, SLIDING=window > 0, IEEE=q.dtype == torch.float32),
        num_warps=4, num_stages=2,
    )]
    if num_splits > 1:
        launches.append(Launch(
            _decode_merge_kernel, (s, h),
            (part_o, part_lse, out,
             *part_o.stride(), *part_lse.stride(), *out.stride(),
             num_splits),
            dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SPLITS=MAX_SPLITS),   # one variant for every count
            num_warps=4 if block_d >= 128 else 2,
        ))
    return launches
