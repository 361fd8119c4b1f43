"""kv_cache_dtype=bfloat16 on the CPU: the C KV store rounds to bfloat16 as torch does, and the C
decode attention reads bfloat16 caches (float32 queries) as the reference does."""
import pytest
import torch

from kernels.cpu import elementwise as ew
from kernels import reference
from kernels.cpu.decode_attention import decode_attention
from kernel_testutil import build_paged_cache, seed_for


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 1, 128, 1), (6, 2, 48, 32)])
def test_decode_attention_reads_a_bf16_cache(num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(seed_for("cpu-bf16-decode", num_heads, block_size))
    lens = [1, block_size + 1, 37, 300, 5]
    k_cache, v_cache, tables = build_paged_cache(lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
    assert out.dtype == torch.float32
    expected = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_store_kv_rounds_to_bf16_like_torch():
    gen = torch.Generator().manual_seed(seed_for("cpu-bf16-store"))
    key, value = torch.randn(7, 3, 64, generator=gen) * 100, torch.randn(7, 3, 64, generator=gen)
    key[0, 0, :4] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -0.0, 65504.0])  # ties to even
    slots = torch.tensor([3, -1, 0, 17, 9, -1, 30], dtype=torch.int64)
    k_cache = torch.full((4, 8, 3, 64), 7.0, dtype=torch.bfloat16)
    v_cache, ref_k, ref_v = k_cache.clone(), k_cache.clone(), k_cache.clone()
    reference.store_kv(key, value, ref_k, ref_v, slots)
    ew.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.int16), ref_k.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), ref_v.view(torch.int16))


def test_a_float16_cache_is_refused():
    k_cache = torch.zeros(2, 4, 1, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="caches must be float32 or bfloat16"):
        ew.store_kv(torch.zeros(1, 1, 32), torch.zeros(1, 1, 32), k_cache, k_cache.clone(), torch.tensor([0]))
