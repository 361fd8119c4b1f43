"""Sliding-window attention (a local layer: each query sees its last `window` positions, itself
included): the torch references against attention written out in float64, then the Triton decode
and prefill kernels (interpreter) and the C decode kernel against the references. Every position no
query may see holds POISON, so a kernel that reads before the window (rather than skipping it)
fails; lengths and windows are not block multiples, and the GQA ratios are 1, 4 and 8."""
import pytest
import torch

from kernels import reference

from kernels.gpu import triton_ops
from kernels.cpu.decode_attention import decode_attention as cpu_decode_attention
from kernel_testutil import DEVICE, POISON, TOL, assert_close, build_paged_cache, seed_for


def poison_before(k_cache, v_cache, tables, seen_from: list[int]) -> None:
    """POISON into sequence i's slots of positions < seen_from[i] (no query of the test sees them)."""
    bs = k_cache.shape[1]
    for i, first in enumerate(seen_from):
        for p in range(first):
            block = int(tables[i, p // bs])
            k_cache[block, p % bs] = POISON
            v_cache[block, p % bs] = POISON


def naive(q, k_cache, v_cache, tables, q_positions, seq_of, scale, window):
    """Each query row against its sequence's keys max(0, p - window + 1) .. p, float64, by hand."""
    t, h, d = q.shape
    bs, g = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(t, h, d, dtype=torch.float64)
    for r in range(t):
        p, s = q_positions[r], seq_of[r]
        keys = range(max(0, p - window + 1) if window else 0, p + 1)
        slots = [int(tables[s, k // bs]) * bs + k % bs for k in keys]
        k = k_cache.reshape(-1, g, d)[slots].double()
        v = v_cache.reshape(-1, g, d)[slots].double()
        for head in range(h):
            kv = head // (h // g)
            out[r, head] = torch.softmax(k[:, kv] @ q[r, head].double() * scale, dim=0) @ v[:, kv]
    return out


def decode_case(lens, window, heads, kv_heads, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = build_paged_cache(lens, block_size, kv_heads, head_dim, dtype, gen)
    poison_before(k_cache, v_cache, tables, [max(0, n - window) for n in lens])
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def prefill_case(q_lens, ctx_lens, window, heads, kv_heads, head_dim, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    k_cache, v_cache, tables = build_paged_cache(lens, block_size, kv_heads, head_dim, dtype, gen)
    poison_before(k_cache, v_cache, tables, [max(0, c - window + 1) for c in ctx_lens])
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, cu, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


# -- the references are the oracle of the kernels: check them against float64 by hand ---------------

@pytest.mark.parametrize("window", [1, 7, 16, 13, 500])
@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_decode_sees_only_the_window(window, block_size):
    lens = [1, 6, 7, 8, 29, 150, 16]   # shorter, equal and longer than the window; several length groups
    q, k_cache, v_cache, tables, seq_lens = decode_case(lens, window, 8, 2, 32, block_size, torch.float32,
                                                        seed_for("ref-decode-window", window, block_size))
    out = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, window=window)
    expected = naive(q, k_cache, v_cache, tables, [n - 1 for n in lens], list(range(len(lens))), 0.2, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # the GPU branch (no host read of the lengths, padded to a bound) computes the same
    padded = reference._decode_padded(q, k_cache, v_cache, tables, seq_lens, 160, 0.2, window)
    torch.testing.assert_close(padded.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 13, 33, 500])
def test_reference_prefill_sees_only_the_window(window):
    q_lens, ctx_lens = [40, 9, 1, 23], [0, 30, 61, 5]   # a fresh prompt, chunks after context
    q, k_cache, v_cache, tables, cu, seq_lens = prefill_case(q_lens, ctx_lens, window, 4, 2, 32, 16,
                                                             torch.float32, seed_for("ref-prefill-window", window))
    positions = [c + i for q_len, c in zip(q_lens, ctx_lens) for i in range(q_len)]
    seq_of = [s for s, q_len in enumerate(q_lens) for _ in range(q_len)]
    expected = naive(q, k_cache, v_cache, tables, positions, seq_of, 0.3, window)
    out = reference.prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.3, window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    padded = reference._prefill_padded(q, k_cache, v_cache, tables, cu, seq_lens, 0.3, max(q_lens), window)
    torch.testing.assert_close(padded.double(), expected, atol=1e-5, rtol=1e-5)


# -- the Triton kernels (interpreter) and the C kernel against the references -----------------------

# (dtype, query heads, kv heads, window, block size): windows under, across and over a block, GQA 4
# with each, then GQA 1 and 8, and float16 (the interpreter's float32 and float16 are right; bf16
# only on a GPU)
KERNEL_CASES = [(torch.float32, 8, 2, 7, 16), (torch.float32, 8, 2, 13, 1), (torch.float32, 8, 2, 100, 32),
                (torch.float32, 4, 4, 40, 16), (torch.float32, 8, 1, 40, 16), (torch.float16, 8, 2, 13, 16)]


@pytest.mark.parametrize("dtype,heads,kv_heads,window,block_size", KERNEL_CASES)
def test_triton_decode_window(dtype, heads, kv_heads, window, block_size):
    lens = [1, window - 1, window, window + 1, 3 * window + 5, 150]
    args = decode_case(lens, window, heads, kv_heads, 64, block_size, dtype,
                       seed_for("tri-decode-window", dtype, heads, kv_heads, window, block_size))
    for splits in (1, 3):   # one pass; split-K over the window (splits of a window, not of the sequence)
        out = triton_ops.decode_attention(*args, 0.125, window=window, num_splits=splits)
        ref = reference.decode_attention(*args, 0.125, window=window)
        assert_close(out, ref, TOL[dtype], f"decode window={window} splits={splits}")


@pytest.mark.parametrize("dtype,heads,kv_heads,window,block_size", KERNEL_CASES)
def test_triton_prefill_window(dtype, heads, kv_heads, window, block_size):
    # windows shorter than a tile (32 under the interpreter) and longer; chunks with and without context
    q_lens, ctx_lens = [37, 9, 1, 50], [0, 37, 80, 11]
    q, k_cache, v_cache, tables, cu, lens = prefill_case(
        q_lens, ctx_lens, window, heads, kv_heads, 32, block_size, dtype,
        seed_for("tri-prefill-window", dtype, heads, kv_heads, window, block_size))
    ref = reference.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125, window=window)
    tiles = ((None, None), (16, 64), (64, 16)) if block_size == 16 and heads == 8 else ((None, None),)
    for block_m, block_n in tiles:   # the left-edge phase moves with the tiles
        out = triton_ops.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125, window=window,
                                           max_q_len=max(q_lens), block_m=block_m, block_n=block_n)
        assert_close(out, ref, TOL[dtype], f"prefill window={window} tiles={block_m},{block_n}")


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (8, 2, 64), (8, 1, 128), (6, 2, 48)])
@pytest.mark.parametrize("window,block_size", [(7, 16), (13, 1), (40, 16), (300, 32)])
def test_cpu_decode_window(heads, kv_heads, head_dim, window, block_size):
    lens = [0, 1, window, window + 3, 2 * window - 1, 700]   # 700: split into chunks that merge
    q, k_cache, v_cache, tables, seq_lens = decode_case(
        [max(n, 1) for n in lens], window, heads, kv_heads, head_dim, block_size, torch.float32,
        seed_for("cpu-decode-window", heads, head_dim, window, block_size))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = cpu_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window=window)
    assert torch.equal(out[0], torch.zeros_like(out[0]))   # a padding row of no tokens
    ref = reference.decode_attention(q[1:], k_cache, v_cache, tables[1:], seq_lens[1:], 0.125, window=window)
    torch.testing.assert_close(out[1:], ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [-1, 2.5, True])
def test_a_bad_window_is_named(window):
    q, k_cache, v_cache, tables, seq_lens = decode_case([5], 4, 4, 2, 32, 16, torch.float32, 0)
    for fn in (triton_ops.decode_attention, cpu_decode_attention):
        with pytest.raises(ValueError, match="window must be an integer >= 0"):
            fn(q, k_cache, v_cache, tables, seq_lens, 0.1, window=window)


# -- GeGLU --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [1, 160, 1500])
def test_gelu_tanh_mul_matches_the_reference_and_transformers(dtype, inter):
    from transformers.activations import ACT2FN
    gen = torch.Generator().manual_seed(seed_for("geglu", dtype, inter))
    x = (3 * torch.randn(5, 2 * inter, generator=gen)).to(dtype).to(DEVICE)
    ref = reference.gelu_tanh_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(ref.float(), (ACT2FN["gelu_pytorch_tanh"](gate) * up).to(dtype).float(),
                               atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-5 if dtype == torch.float32 else 2e-3)
    assert_close(triton_ops.gelu_tanh_mul(x), ref, TOL[dtype], "gelu_tanh_mul")
    assert not torch.allclose(ref.float(), reference.silu_mul(x).float())   # a different activation
