"""Paged causal prefill attention (Triton) against kernels.reference.prefill_attention."""
import pytest
import torch

from kernels import reference
from kernels.gpu import triton_ops
from kernel_testutil import DEVICE, DTYPES, TOL, assert_close, build_paged_cache, seed_for


def _run(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, strided_q=False, **kw):
    """Sequence i: a chunk of q_lens[i] queries after ctx_lens[i] tokens already cached."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    k_cache, v_cache, tables = build_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    t = sum(q_lens)
    if strided_q:
        qkv = torch.randn(t, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        q = qkv[:, :num_heads]
    else:
        q = torch.randn(t, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = triton_ops.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, **kw)
    ref = reference.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])   # GQA ratios 1, 4, 8
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_reference(dtype, block_size, num_heads, num_kv_heads, head_dim):
    # A fresh prompt (no context), a later chunk of a chunked prefill (context not a block
    # multiple), and a single-token chunk after a long context (prefix reuse hit).
    q_lens = [21, 35, 1]
    ctx_lens = [0, 19, 70]
    out, ref = _run(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                    seed_for("prefill", dtype, block_size, num_heads, num_kv_heads, head_dim))
    assert_close(out, ref, TOL[dtype], f"prefill {dtype} bs={block_size} H={num_heads} G={num_kv_heads} D={head_dim}")


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (64, 16), (16, 64)])
def test_prefill_tile_sizes(block_m, block_n):
    # Query tiles larger and smaller than kv tiles move the diagonal (masked) phase around.
    q_lens = [50, 7, 33]
    ctx_lens = [3, 40, 0]
    out, ref = _run(q_lens, ctx_lens, 8, 2, 64, 16, torch.float32, seed_for("ptiles", block_m, block_n),
                    block_m=block_m, block_n=block_n)
    assert_close(out, ref, TOL[torch.float32], f"prefill block_m={block_m} block_n={block_n}")


def test_prefill_empty_chunk_strided_q_and_grid_bound():
    # A sequence with no queries this step, q as a strided view, and the grid sized by the total
    # token count (what the wrapper does on CUDA without max_q_len): surplus programs must exit.
    q_lens = [12, 0, 30]
    ctx_lens = [0, 9, 5]
    t = sum(q_lens)
    out, ref = _run(q_lens, ctx_lens, 4, 2, 64, 16, torch.float32, seed_for("pempty"), strided_q=True,
                    max_q_len=t)
    assert_close(out, ref, TOL[torch.float32], "prefill empty chunk")


def test_prefill_int64_indices():
    gen = torch.Generator().manual_seed(seed_for("pint64"))
    k_cache, v_cache, tables = build_paged_cache([20, 40], 16, 2, 64, torch.float32, gen)
    q = torch.randn(30, 4, 64, generator=gen).to(DEVICE)
    cu = torch.tensor([0, 10, 30], device=DEVICE)
    lens = torch.tensor([20, 40], device=DEVICE)
    out = triton_ops.prefill_attention(q, k_cache, v_cache, tables.long(), cu, lens, 0.125)
    ref = reference.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)
    assert_close(out, ref, TOL[torch.float32], "prefill int64")


@pytest.mark.parametrize("change,match", [
    (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)), "cu_seqlens_q must have shape"),
    (dict(q=torch.zeros(8, 4, 64, dtype=torch.float16)), "dtype"),
    (dict(q=torch.zeros(8, 3, 64)), "multiple of num_kv_heads"),
    (dict(block_tables=torch.zeros(2, 2, dtype=torch.float32)), "block_tables must have dtype"),
    (dict(k_cache=torch.zeros(4, 16, 64)), "k_cache must be 4-D"),
])
def test_prefill_rejects_bad_arguments(change, match):
    args = dict(q=torch.zeros(8, 4, 64), k_cache=torch.zeros(4, 16, 2, 64), v_cache=torch.zeros(4, 16, 2, 64),
                block_tables=torch.zeros(2, 2, dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 5, 8], dtype=torch.int32),
                seq_lens=torch.tensor([5, 3], dtype=torch.int32))
    args.update(change)
    args = {k: v.to(DEVICE) for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        triton_ops.prefill_attention(scale=0.1, **args)


@pytest.mark.parametrize("head_dim", [8, 80])
def test_prefill_small_and_odd_head_dims(head_dim):
    # Below the 16-wide tl.dot minimum (padded with masked zeros) and not a power of two.
    out, ref = _run([9, 20], [0, 13], 4, 2, head_dim, 16, torch.float32, seed_for("phd", head_dim))
    assert_close(out, ref, TOL[torch.float32], f"prefill D={head_dim}")
