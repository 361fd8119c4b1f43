"""The torch prefill attention (the engine's CPU path, SDPA) against attention written out one
sequence, one head and one query at a time in float64: whole prompts (plain causal) and chunks that
follow cached context (the causal offset), with GQA, block sizes that do not divide the lengths."""
import random

import pytest
import torch

from kernels import reference
from kernel_testutil import build_paged_cache, seed_for


def _naive(q, k_cache, v_cache, tables, q_lens, seq_lens, scale):
    h, d = q.shape[1], q.shape[2]
    bs, g = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (q_len, n) in enumerate(zip(q_lens, seq_lens)):
        slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(n)]
        k = k_cache.reshape(-1, g, d)[slots].double()
        v = v_cache.reshape(-1, g, d)[slots].double()
        for j in range(q_len):
            visible = n - q_len + j + 1  # the query at position n - q_len + j sees keys 0..that
            for head in range(h):
                kv = head // (h // g)
                p = torch.softmax(k[:visible, kv] @ q[row + j, head].double() * scale, dim=0)
                out[row + j, head] = p @ v[:visible, kv]
        row += q_len
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_matches_per_query_attention(num_heads, num_kv_heads, block_size):
    rng = random.Random(seed_for("prefill", num_heads, block_size))
    q_lens = [1, 7, 33] + [rng.randint(1, 40) for _ in range(3)]
    cached = [0, 0, 20, rng.randint(1, 60), 0, rng.randint(1, 60)]  # context before the chunk
    seq_lens = [q + c for q, c in zip(q_lens, cached)]
    gen = torch.Generator().manual_seed(seed_for("prefill-data", num_heads, block_size))
    k_cache, v_cache, tables = (t.cpu() for t in build_paged_cache(seq_lens, block_size, num_kv_heads, 16,
                                                                     torch.float32, gen))
    q = torch.randn(sum(q_lens), num_heads, 16, generator=gen)
    cu = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    out = reference.prefill_attention(q, k_cache, v_cache, tables, cu, torch.tensor(seq_lens, dtype=torch.int32),
                                      0.3)
    torch.testing.assert_close(out.double(), _naive(q, k_cache, v_cache, tables, q_lens, seq_lens, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_prefill_half_precision_comes_back_in_its_dtype():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = (t.cpu() for t in build_paged_cache([40], 16, 2, 16, torch.float16, gen))
    q = torch.randn(40, 4, 16, generator=gen).half()
    out = reference.prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, 40], dtype=torch.int32),
                                      torch.tensor([40], dtype=torch.int32), 0.25)
    assert out.dtype == torch.float16
    want = _naive(q.float(), k_cache.float(), v_cache.float(), tables, [40], [40], 0.25)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
