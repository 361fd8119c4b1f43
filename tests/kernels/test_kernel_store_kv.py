"""KV-cache store (Triton) against kernels.reference.store_kv."""
import pytest
import torch

from kernels import reference
from kernels.gpu import triton_ops
from kernel_testutil import DEVICE, DTYPES, seed_for


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 128), (8, 64)])
def test_store_kv_matches_reference(dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(seed_for("store", dtype, block_size, num_kv_heads, head_dim))
    t, nb = 23, 5   # 23 tokens: not a block multiple
    g, d = num_kv_heads, head_dim
    # key/value as strided slices of a fused qkv activation, as the model hands them over.
    qkv = torch.randn(t, 3 * g + 1, d, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, g + 1:2 * g + 1], qkv[:, 2 * g + 1:]
    nslots = nb * block_size
    slots = torch.randperm(max(nslots, t), generator=gen)[:t]
    slots[slots >= nslots] = -1
    slots[torch.randperm(t, generator=gen)[:4]] = -1   # padding tokens
    slots = slots.to(DEVICE)
    # Caches start as NaN: every slot the kernel should not touch must still be NaN afterwards.
    caches = [torch.full((nb, block_size, g, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    triton_ops.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    for got, want, what in ((caches[0], caches[2], "k"), (caches[1], caches[3], "v")):
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: written slots differ"
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), f"{what}: values differ"
    written = (~torch.isnan(caches[0]).view(nslots, -1).all(-1)).sum().item()
    assert written == int((slots >= 0).sum())


def test_store_kv_converts_to_cache_dtype():
    gen = torch.Generator().manual_seed(seed_for("store-cast"))
    key = torch.randn(6, 2, 64, generator=gen).to(DEVICE)
    value = torch.randn(6, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([3, 0, -1, 7, 12, 5], device=DEVICE)
    got = [torch.full((4, 4, 2, 64), float("nan"), dtype=torch.float16, device=DEVICE) for _ in range(2)]
    want = [c.clone() for c in got]
    triton_ops.store_kv(key, value, *got, slots.int())
    reference.store_kv(key, value, *want, slots)
    for a, b in zip(got, want):
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        assert torch.equal(torch.isnan(a), torch.isnan(b))


@pytest.mark.parametrize("change,match", [
    (dict(value=torch.zeros(4, 2, 32)), "value shape"),
    (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), "slot_mapping must have shape"),
    (dict(slot_mapping=torch.zeros(4)), "slot_mapping must have dtype"),
    (dict(k_cache=torch.zeros(2, 8, 4, 64), v_cache=torch.zeros(2, 8, 4, 64)), "kv heads"),
])
def test_store_kv_rejects_bad_arguments(change, match):
    args = dict(key=torch.zeros(4, 2, 64), value=torch.zeros(4, 2, 64), k_cache=torch.zeros(2, 8, 2, 64),
                v_cache=torch.zeros(2, 8, 2, 64), slot_mapping=torch.zeros(4, dtype=torch.int64))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        triton_ops.store_kv(**{k: v.to(DEVICE) for k, v in args.items()})
