"""The torch decode attention (the engine's CPU path) groups sequences by length: check it against
attention written out one sequence at a time, in float64, and check the grouping rule itself."""
import random

import pytest
import torch

from kernels import reference
from kernel_testutil import build_paged_cache, seed_for


def _naive(q, k_cache, v_cache, tables, lens, scale):
    """softmax(q k^T) v per sequence and head, float64, from the block table by hand."""
    s, h, d = q.shape
    bs, g = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(s, h, d, dtype=torch.float64)
    for i, n in enumerate(lens):
        slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(n)]
        k = k_cache.reshape(-1, g, d)[slots].double()
        v = v_cache.reshape(-1, g, d)[slots].double()
        for head in range(h):
            kv = head // (h // g)
            p = torch.softmax(k[:, kv] @ q[i, head].double() * scale, dim=0)
            out[i, head] = p @ v[:, kv]
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_grouped_decode_matches_per_sequence_attention(num_heads, num_kv_heads, block_size):
    rng = random.Random(seed_for("grouped", num_heads, block_size))
    lens = [1, 2, 17] + [rng.randint(1, 300) for _ in range(20)]  # several length groups
    assert len(reference.length_groups(lens)) > 2
    gen = torch.Generator().manual_seed(seed_for("grouped-data", num_heads, block_size))
    k_cache, v_cache, tables = build_paged_cache(lens, block_size, num_kv_heads, 32, torch.float32, gen)
    k_cache, v_cache, tables = k_cache.cpu(), v_cache.cpu(), tables.cpu()
    q = torch.randn(len(lens), num_heads, 32, generator=gen)
    out = reference.decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.17)
    torch.testing.assert_close(out.double(), _naive(q, k_cache, v_cache, tables, lens, 0.17),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(20))
def test_length_groups_partition_and_bound_the_padding(seed):
    rng = random.Random(seed)
    lens = [rng.choice([1, rng.randint(1, 50), rng.randint(1, 3000)]) for _ in range(rng.randint(1, 80))]
    groups = reference.length_groups(lens, max_waste=1.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        longest = lens[g[0]]
        assert longest == max(lens[i] for i in g)
        assert longest * len(g) <= 1.25 * sum(lens[i] for i in g) or len(g) == 1
    assert len(reference.length_groups([7] * 64)) == 1  # equal lengths: one gather, as before
