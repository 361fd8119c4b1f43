"""Paged decode attention (Triton) against kernels.reference.decode_attention."""
import pytest
import torch

from kernels import reference
from kernels.gpu import triton_ops
from kernels.gpu.decode_attention import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, choose_num_splits
from kernel_testutil import DEVICE, DTYPES, TOL, assert_close, build_paged_cache, seed_for


def _run(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, strided_q=False, **kw):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = build_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    s = len(seq_lens)
    if strided_q:  # q as a slice of a fused qkv activation, as the model produces it
        qkv = torch.randn(s, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        q = qkv[:, :num_heads]
    else:
        q = torch.randn(s, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = triton_ops.decode_attention(q, k_cache, v_cache, tables, lens, scale, **kw)
    ref = reference.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])   # GQA ratios 1, 4, 8
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_reference(dtype, block_size, num_heads, num_kv_heads, head_dim):
    # Context 1, lengths that are not block (or tile) multiples, and one spanning many blocks.
    seq_lens = [1, 37, 150]
    out, ref = _run(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                    seed_for("decode", dtype, block_size, num_heads, num_kv_heads, head_dim))
    assert_close(out, ref, TOL[dtype], f"decode {dtype} bs={block_size} H={num_heads} G={num_kv_heads} D={head_dim}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_decode_split_k(dtype, num_splits):
    # A long context cut into several splits; the short sequences leave most splits empty
    # (their partials carry lse = -inf and must not disturb the merge).
    seq_lens = [300, 5, 64, 129]
    out, ref = _run(seq_lens, 8, 2, 64, 16, dtype, seed_for("split", dtype, num_splits),
                    num_splits=num_splits)
    assert_close(out, ref, TOL[dtype], f"decode split-K={num_splits} {dtype}")


@pytest.mark.parametrize("block_n,block_size", [(16, 32), (128, 16), (32, 1)])
def test_decode_tile_sizes(block_n, block_size):
    # Tiles smaller than a cache block, larger than one, and one token per block.
    seq_lens = [200, 33, 1]
    out, ref = _run(seq_lens, 8, 2, 64, block_size, torch.float32, seed_for("tiles", block_n, block_size),
                    block_n=block_n, num_splits=2)
    assert_close(out, ref, TOL[torch.float32], f"decode block_n={block_n} bs={block_size}")


def test_decode_default_heuristic_splits_and_strided_q():
    # Default arguments (the engine's call); q is a strided view of a fused qkv tensor.
    seq_lens = [400, 17]
    out, ref = _run(seq_lens, 8, 2, 64, 16, torch.float32, seed_for("default"), strided_q=True)
    assert_close(out, ref, TOL[torch.float32], "decode default")


def test_decode_int64_indices_and_empty_sequence():
    gen = torch.Generator().manual_seed(seed_for("int64"))
    seq_lens = [0, 20, 3]
    k_cache, v_cache, tables = build_paged_cache(seq_lens, 16, 2, 64, torch.float32, gen)
    q = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
    for ns in (1, 3):
        out = triton_ops.decode_attention(q, k_cache, v_cache, tables.long(), lens, 0.125, num_splits=ns)
        ref = reference.decode_attention(q[1:], k_cache, v_cache, tables[1:], lens[1:], 0.125)
        assert_close(out[1:], ref, TOL[torch.float32], f"decode int64 indices splits={ns}")
        # A sequence with nothing cached attends to nothing: zeros (the reference gives NaN).
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_decode_no_sequences():
    k_cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    out = triton_ops.decode_attention(torch.zeros(0, 4, 64, device=DEVICE), k_cache, k_cache,
                                      torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
                                      torch.zeros(0, dtype=torch.int32, device=DEVICE), 0.1)
    assert out.shape == (0, 4, 64)


def test_choose_num_splits():
    sms = 132
    # Enough programs already: no split.
    assert choose_num_splits(64, 8, 4096, sms) == 1
    # Batch 1 of a long context: many splits, bounded by MAX_SPLITS.
    n = choose_num_splits(1, 8, 32768, sms)
    assert 1 < n <= MAX_SPLITS
    # Never split below MIN_TOKENS_PER_SPLIT tokens per split.
    assert choose_num_splits(1, 8, 3 * MIN_TOKENS_PER_SPLIT, sms) == 3
    assert choose_num_splits(1, 8, MIN_TOKENS_PER_SPLIT - 1, sms) == 1
    # More sequences -> fewer splits.
    assert choose_num_splits(16, 8, 4096, sms) < choose_num_splits(2, 8, 4096, sms)


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(2, 5, 64)), "multiple of num_kv_heads"),
    (dict(q=torch.zeros(2, 4, 32)), "q head_dim 32 != cache head_dim 64"),
    (dict(q=torch.zeros(2, 4, 64, dtype=torch.float16)), "dtype"),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), "seq_lens must have shape"),
    (dict(seq_lens=torch.zeros(2)), "seq_lens must have dtype"),
    (dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)), "block_tables has 3 rows"),
    (dict(v_cache=torch.zeros(4, 16, 2, 32)), "v_cache shape"),
])
def test_decode_rejects_bad_arguments(change, match):
    args = dict(q=torch.zeros(2, 4, 64), k_cache=torch.zeros(4, 16, 2, 64), v_cache=torch.zeros(4, 16, 2, 64),
                block_tables=torch.zeros(2, 2, dtype=torch.int32), seq_lens=torch.ones(2, dtype=torch.int32))
    args.update(change)
    args = {k: v.to(DEVICE) for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        triton_ops.decode_attention(scale=0.1, **args)


@pytest.mark.parametrize("head_dim", [8, 80])
def test_decode_small_and_odd_head_dims(head_dim):
    # Below the 16-wide tl.dot minimum (padded with masked zeros) and not a power of two.
    out, ref = _run([1, 45], 4, 2, head_dim, 16, torch.float32, seed_for("hd", head_dim), num_splits=2)
    assert_close(out, ref, TOL[torch.float32], f"decode D={head_dim}")
