"""Torch references for every kernel, with the same signatures as the Triton wrappers.

They are the CPU path of the engine and the oracle of the kernel tests, so they favour clarity and
float32 accumulation over speed.

Shapes (T tokens in the flat batch, H query heads, G kv heads, D head dim, NB cache blocks,
BS block size, S sequences, MB max blocks per sequence):
  k_cache, v_cache: [NB, BS, G, D]      block_tables: [S, MB] int32
  slot_mapping: [T] int64, slot = block * BS + offset; -1 means "do not store"
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def host_reads_are_free(t: torch.Tensor) -> bool:
    """Reading t's values on the host costs nothing on the CPU; on a GPU it stalls the host until the
    device catches up, in every layer. The references take a branch without such reads there."""
    return t.device.type == "cpu"


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, G, D] into the paged cache at slot_mapping [T] (in place); slot -1 skips.

    Dropping the skipped rows would need their count on the host (a boolean mask: a device sync).
    Instead each skipped row writes what a stored row writes (the nearest stored row before it, or
    the first stored row): a duplicate of a store, which is harmless. With no stored row at all,
    every row writes the first cache slot's own contents back."""
    nb, bs, g, d = k_cache.shape
    t = slot_mapping.shape[0]
    if t == 0:
        return
    stored = slot_mapping >= 0
    rows = torch.arange(t, device=slot_mapping.device)
    last_stored = torch.where(stored, rows, -1).cummax(0).values
    source = torch.where(last_stored >= 0, last_stored, stored.int().argmax())   # argmax: the first stored
    slots = slot_mapping[source].clamp(min=0)
    any_stored = stored.any()
    for new, cache in ((key, k_cache), (value, v_cache)):
        flat = cache.view(nb * bs, g, d)
        flat.index_put_((slots,), torch.where(any_stored, new[source].to(cache.dtype), flat[slots]))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """Cached tokens start..length-1 of one sequence as [length - start, G, D]: only the blocks that
    hold them are read (a sliding window's tokens start anywhere in their first block)."""
    bs = cache.shape[1]
    first, nblocks = start // bs, (length + bs - 1) // bs
    blocks = cache[block_table[first:nblocks].long()]  # [n, BS, G, D]
    return blocks.reshape(-1, *cache.shape[2:])[start - first * bs:length - first * bs]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int = 0) -> torch.Tensor:
    """One sequence's chunk: q [Q, H, D] at the last Q of the K positions of k/v [K, G, D] ->
    [Q, H, D], float32 math. torch's SDPA (its CPU flash kernel) walks the keys in tiles, so no
    [H, Q, K] score matrix, mask or softmax is ever materialized (at 4k tokens that was ~0.5 GB per
    layer). Query row i sits at position K - Q + i: when the chunk is the whole sequence that is
    the plain causal mask; after cached context (a previous chunk, a reused prefix) the offset
    needs an explicit [Q, K] boolean mask, 1 byte per pair instead of three fp32 matrices, and so
    does a sliding window (a query sees keys q - window < k <= q, as HF's sliding-window mask)."""
    nq, nk = q.shape[0], k.shape[0]
    # [1, heads, tokens, D] views: the CPU flash kernel takes only 4-d inputs (3-d ones fall back
    # to the math path, which materializes the scores: 6x slower at 2k tokens) and any strides.
    qh = q.float().transpose(0, 1)[None]
    kh, vh = k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None]
    banded = 0 < window < nk  # a window as long as the keys changes nothing
    if nq == nk and not banded:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(nk - nq, nk, device=q.device)[:, None]
        k_pos = torch.arange(nk, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [Q, K]
        if banded:
            mask &= k_pos > q_pos - window
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    out = out[0]
    return out.transpose(0, 1).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                     max_seq_len: Optional[int] = None, window: int = 0) -> torch.Tensor:
    """One query token per sequence. q [S, H, D]; seq_lens [S] = cached tokens to attend to
    (the query's own K/V already stored). Returns [S, H, D]. `window` > 0: each query sees only
    the last `window` of them (a sliding-window layer); the blocks before are not read.

    On the CPU sequences are gathered in groups of similar length (`length_groups`), each padded to
    its own longest, so a batch of mixed lengths costs about what its tokens cost, not S x the
    longest. On a GPU, where reading the lengths would sync, all are padded to max_seq_len (the
    caller's host-side bound; default the block tables' capacity)."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if not host_reads_are_free(seq_lens):   # one padded pass to the host-known bound, no device read
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
        return _decode_padded(q, k_cache, v_cache, block_tables, seq_lens, bound, scale, window)
    lens = seq_lens.tolist()
    spans = [min(n, window) for n in lens] if window else lens  # the tokens each query reads
    groups = length_groups(spans)
    if len(groups) == 1:
        return _decode_padded(q, k_cache, v_cache, block_tables, seq_lens, max(spans), scale, window)
    # Sort once by group, so that each group is a slice (a view) rather than an indexed copy.
    order = torch.tensor([i for rows in groups for i in rows], device=q.device)
    qs, tables, sorted_lens = q[order], block_tables[order], seq_lens[order]
    parts, start = [], 0
    for rows in groups:
        end = start + len(rows)
        parts.append(_decode_padded(qs[start:end], k_cache, v_cache, tables[start:end],
                                    sorted_lens[start:end], spans[rows[0]], scale, window))
        start = end
    out = torch.empty_like(q)
    out[order] = torch.cat(parts)
    return out


def length_groups(lens: list[int], max_waste: float = 1.5) -> list[list[int]]:
    """Indices of `lens` in groups, longest first, such that padding every member of a group to
    the group's longest costs at most `max_waste` x the group's real length."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and lens[groups[-1][0]] * (len(groups[-1]) + 1) <= max_waste * (total + lens[i]):
            groups[-1].append(i)
            total += lens[i]
        else:
            groups.append([i])
            total = lens[i]
    return groups


def _decode_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                   scale: float, window: int = 0) -> torch.Tensor:
    """Gather every sequence's K/V padded to max_len ([S, K, G, D]) and mask past each seq_len
    (and, with a window, before seq_len - window: each row's gather starts at the block holding
    its window's first token, so max_len bounds the window's tokens, not the sequence's).

    Whole blocks are gathered with index_select (on CPU several times faster than advanced
    indexing), and each kv head's scores are one batched matmul that reads K/V in place through
    strides, so no transposed copy of the context is made."""
    s, h, d = q.shape
    nb, bs, g = k_cache.shape[:3]
    rep = h // g
    lens = seq_lens.to(q.device).long()
    if window:
        span = min(max_len, window) + bs - 1   # the window may start anywhere in its first block
        first = (lens - window).clamp(min=0) // bs   # [S] each row's first block
    else:
        span, first = max_len, torch.zeros_like(lens)
    width = block_tables.shape[1]
    nblocks = min((span + bs - 1) // bs, width)
    cols = (first[:, None] + torch.arange(nblocks, device=q.device)).clamp(max=width - 1)
    rows = block_tables.long().gather(1, cols).reshape(-1)
    k = k_cache.reshape(nb, -1).index_select(0, rows).view(s, nblocks * bs, g, d)
    v = v_cache.reshape(nb, -1).index_select(0, rows).view(s, nblocks * bs, g, d)
    pos = first[:, None] * bs + torch.arange(nblocks * bs, device=q.device)   # [S, K] each key's position
    outside = pos >= lens[:, None]
    if window:
        outside |= pos < lens[:, None] - window
    outside = outside[:, None, :]  # [S, 1, K]
    qg = q.float().reshape(s, g, rep, d) * scale
    out = torch.empty(s, g, rep, d, dtype=torch.float32, device=q.device)
    for j in range(g):  # query heads j*rep .. (j+1)*rep-1 read kv head j
        scores = torch.bmm(qg[:, j], k[:, :, j].float().transpose(1, 2))  # [S, rep, K]
        out[:, j] = torch.bmm(torch.softmax(scores.masked_fill_(outside, float("-inf")), dim=-1),
                              v[:, :, j].float())
    return out.reshape(s, h, d).to(q.dtype)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, *, max_q_len: Optional[int] = None, window: int = 0) -> torch.Tensor:
    """Causal attention for packed query chunks that read the paged cache; with `window` > 0 each
    query sees only its last `window` positions (itself included), and keys before the chunk's
    first window are not read.

    q [T, H, D] holds S sequences back to back, sequence i at rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
    seq_lens[i] counts all cached tokens of sequence i, the chunk's own included (already stored),
    so the chunk's queries sit at positions seq_lens[i] - q_len .. seq_lens[i] - 1. Earlier context
    (a previous chunk, a reused prefix) is read from the cache like the rest. max_q_len (the
    longest chunk, known on the host) lets the Triton kernel size its grid without a device read.
    """
    if not host_reads_are_free(seq_lens):
        return _prefill_padded(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                               max_q_len if max_q_len is not None else q.shape[0], window)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i in range(len(lens)):
        start, end, length = cu[i], cu[i + 1], lens[i]
        q_len = end - start
        if q_len == 0:
            continue
        first = max(0, length - q_len - window + 1) if window else 0  # the first query's window
        k = _gather_context(k_cache, block_tables[i], length, first)
        v = _gather_context(v_cache, block_tables[i], length, first)
        out[start:end] = _causal_attention(q[start:end], k, v, scale, window)
    return out


def _prefill_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_q_len: int,
                    window: int = 0) -> torch.Tensor:
    """prefill_attention with no host read of the lengths (the GPU branch): every chunk padded to
    max_q_len queries and to the tables' capacity in keys, one masked SDPA over all of them, and
    each token's row gathered back. Memory grows with S x max_q_len x capacity (the mask): this is
    the fallback path; the Triton kernel is the GPU's."""
    t, h, d = q.shape
    s = seq_lens.shape[0]
    nb, bs, g, _ = k_cache.shape
    dev = q.device
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]                                              # [S]
    qi = torch.arange(max_q_len, device=dev)
    q_rows = (cu[:-1, None] + qi[None, :]).clamp(max=max(t - 1, 0))       # [S, Q]
    q_valid = qi[None, :] < q_lens[:, None]
    q_pos = seq_lens.long()[:, None] - q_lens[:, None] + qi[None, :]       # each query's position
    keys = block_tables.shape[1] * bs
    k_pos = torch.arange(keys, device=dev)
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]     # [S, Q, K]
    if window:
        visible &= k_pos[None, None, :] > q_pos[:, :, None] - window
    visible[:, :, 0] |= ~q_valid                                  # padded queries see one key: no NaN
    blocks = block_tables.long().reshape(-1)
    k = k_cache.index_select(0, blocks).view(s, keys, g, d)
    v = v_cache.index_select(0, blocks).view(s, keys, g, d)
    qh = q[q_rows].float().transpose(1, 2)                                  # [S, H, Q, D]
    out = F.scaled_dot_product_attention(qh, k.float().transpose(1, 2), v.float().transpose(1, 2),
                                         attn_mask=visible[:, None], scale=scale, enable_gqa=True)
    token = torch.arange(t, device=dev)
    seq_of = torch.searchsorted(cu[1:], token, right=True).clamp(max=s - 1)   # each token's sequence
    return out.transpose(1, 2)[seq_of, token - cu[seq_of]].to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm. x [T, N]. With residual: h = x + residual, else h = x.
    Returns (rmsnorm(h) * weight, h): the second is the next layer's residual."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype), h


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE as in HF Llama. q [T, H, D], k [T, G, D], positions [T],
    cos/sin caches [max_pos, D/2] in float32. Returns new (q, k)."""
    cos = cos_cache[positions.long()][:, None, :]
    sin = sin_cache[positions.long()][:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:].float()
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] (Gemma's GeGLU: HF's
    "gelu_pytorch_tanh", the tanh approximation of GELU)."""
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:].float()
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)
