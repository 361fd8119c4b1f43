"""An fp8 (e4m3) KV cache, `kv_cache_dtype=fp8`: the Triton store saturates to e4m3's range and
converts as torch does, and both attention kernels read the cache in q's dtype, matching the torch
references that read the same cache. On the GPU the same kernels compile for sm_90
(tests/kernels/test_aot.py).

The CPU interpreter's float32 -> e4m3 conversion drops the carry when a value rounds up to the next
power of two (31.8 becomes 16, not 32; the GPU's cvt.rn.satfinite is right), so on the CPU the
stored values are e4m3 values already, where every rounding mode agrees: the test checks the
store's slots, saturation and conversion there, and the GPU's rounding where there is one."""
import pytest
import torch

from kernels import reference
from kernels.gpu import triton_ops
from kernel_testutil import DEVICE, DTYPES, HAS_CUDA, TOL, assert_close, build_paged_cache, seed_for

FP8 = torch.float8_e4m3fn


def test_store_kv_saturates_and_rounds_to_e4m3():
    gen = torch.Generator().manual_seed(seed_for("fp8-store"))
    t, g, d, nb, bs = 19, 2, 64, 4, 16
    key, value = torch.randn(t, g, d, generator=gen) * 40, torch.randn(t, g, d, generator=gen) * 3
    if not HAS_CUDA:  # see the docstring: e4m3 values, which no rounding changes
        key, value = key.to(FP8).float(), value.to(FP8).float()
    key, value = key.to(DEVICE), value.to(DEVICE)
    key[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 1e-4])   # past the range, at its edge, subnormal
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(DEVICE)
    slots[5] = -1
    caches = [torch.full((nb, bs, g, d), float("nan")).to(FP8).to(DEVICE) for _ in range(4)]
    triton_ops.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    for got, want, src in ((caches[0], caches[2], key), (caches[1], caches[3], value)):
        got, want = got.float(), want.float()
        assert torch.equal(torch.isnan(got), torch.isnan(want))                       # the same slots written
        assert int((~torch.isnan(got)).view(nb * bs, -1).all(-1).sum()) == t - 1
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))   # round to nearest even, as torch
    stored = caches[0].float().view(nb * bs, g, d)[int(slots[0])]
    assert stored[0, :3].tolist() == [448.0, -448.0, 448.0]     # saturated, never NaN
    assert not torch.isnan(caches[0].float()).view(nb * bs, -1)[slots[slots >= 0].long()].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_decode_attention_reads_an_fp8_cache_in_q_dtype(dtype, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(seed_for("fp8-decode", dtype, num_heads))
    seq_lens, d = [1, 37, 150], 64
    k_cache, v_cache, tables = build_paged_cache(seq_lens, 16, num_kv_heads, d, FP8, gen)
    q = torch.randn(len(seq_lens), num_heads, d, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        out = triton_ops.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, num_splits=splits)
        ref = reference.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
        assert_close(out, ref, TOL[dtype], f"fp8 cache, {dtype} q, {splits} splits")


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_reads_an_fp8_cache_in_q_dtype(dtype):
    gen = torch.Generator().manual_seed(seed_for("fp8-prefill", dtype))
    q_lens, ctx_lens, h, g, d = [21, 35, 1], [0, 19, 70], 8, 2, 64
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    k_cache, v_cache, tables = build_paged_cache(seq_lens, 16, g, d, FP8, gen)
    q = torch.randn(sum(q_lens), h, d, generator=gen).to(dtype).to(DEVICE)
    cu = torch.tensor([0, 21, 56, 57], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = triton_ops.prefill_attention(q, k_cache, v_cache, tables, cu, lens, d ** -0.5)
    ref = reference.prefill_attention(q, k_cache, v_cache, tables, cu, lens, d ** -0.5)
    assert_close(out, ref, TOL[dtype], f"fp8 cache, {dtype} q")


def test_a_q_cache_dtype_mismatch_other_than_fp8_is_still_refused():
    q = torch.zeros(2, 4, 64, dtype=torch.float16, device=DEVICE)
    cache = torch.zeros(3, 16, 4, 64, dtype=torch.float32, device=DEVICE)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE), torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="q dtype torch.float16 != cache dtype torch.float32"):
        triton_ops.decode_attention(q, cache, cache, tables, lens, 0.125)
