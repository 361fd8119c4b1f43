"""The C elementwise kernels (kernels/cpu/csrc/elementwise.c) against their torch references, on random
inputs with sizes that are not vector multiples, strided rows as the fused qkv split leaves them,
and rows both below and above the size where the OpenMP team is woken."""
import pytest
import torch

from kernels import reference

from kernels.cpu import elementwise as ew
from kernel_testutil import seed_for

TOL = dict(atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rows,width", [(1, 64), (3, 576), (37, 100), (300, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(rows, width, with_residual):
    gen = torch.Generator().manual_seed(seed_for("rms", rows, width, with_residual))
    x = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    residual = torch.randn(rows, width, generator=gen) if with_residual else None
    out, h = ew.rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_h = reference.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(h, ref_h, atol=0, rtol=0)  # an add is an add
    torch.testing.assert_close(out, ref_out, **TOL)


@pytest.mark.parametrize("rows,inner", [(1, 8), (5, 1536), (64, 688), (200, 1536)])
@pytest.mark.parametrize("name", ["silu_mul", "gelu_tanh_mul"])
def test_gated_activations(rows, inner, name):
    gen = torch.Generator().manual_seed(seed_for(name, rows, inner))
    x = torch.randn(rows, 2 * inner, generator=gen) * 4
    x[0, :6] = torch.tensor([-60.0, -12.0, -1e-3, 0.0, 12.0, 60.0])  # saturated tanh both ways, and near 0
    x[-1, :4] = torch.tensor([-89.0, -300.0, -1e4, 95.0])  # e^-g past float32's range (an outlier's gate)
    torch.testing.assert_close(getattr(ew, name)(x), getattr(reference, name)(x), **TOL)


@pytest.mark.parametrize("tokens", [1, 9, 130])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 32), (4, 4, 128)])
def test_rotary_embedding_on_strided_rows(tokens, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(seed_for("rope", tokens, heads, dim))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    cos, sin = torch.randn(512, dim // 2, generator=gen), torch.randn(512, dim // 2, generator=gen)
    got, want = ew.rotary_embedding(q, k, positions, cos, sin), reference.rotary_embedding(q, k, positions, cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_store_kv_skips_slot_minus_one_and_writes_nothing_else():
    gen = torch.Generator().manual_seed(seed_for("store"))
    k_cache, v_cache = torch.randn(6, 16, 3, 64, generator=gen), torch.randn(6, 16, 3, 64, generator=gen)
    kv = torch.randn(7, 2 * 3 * 64, generator=gen)
    key, value = (t.view(7, 3, 64) for t in kv.split([192, 192], dim=-1))  # strided rows
    slots = torch.tensor([5, -1, 17, 95, 0, -1, 40])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, ref_k, ref_v, slots)
    ew.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_bounds_are_checked_and_checked_again_after_a_change():
    k_cache = torch.zeros(2, 4, 1, 8)
    key = torch.zeros(2, 1, 8)
    slots = torch.tensor([0, 7])
    ew.store_kv(key, key, k_cache, k_cache.clone(), slots)
    slots[1] = 8  # the same tensor, changed in place: its version moved, so it is read again
    with pytest.raises(ValueError, match=r"store_kv: slots must lie in \[-1, 8\); got \[0, 8\]"):
        ew.store_kv(key, key, k_cache, k_cache.clone(), slots)
    cos = torch.zeros(10, 4)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 10\)"):
        ew.rotary_embedding(key, key, torch.tensor([3, 10]), cos, cos)


@pytest.mark.parametrize("call,message", [
    (lambda: ew.silu_mul(torch.zeros(2, 7)), "expected [T, 2I]"),
    (lambda: ew.gelu_tanh_mul(torch.zeros(2, 7)), "gelu_tanh_mul: expected [T, 2I]"),
    (lambda: ew.silu_mul(torch.zeros(2, 8, dtype=torch.float64)), "expected float32 CPU tensors"),
    (lambda: ew.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5), "do not agree"),
    (lambda: ew.rotary_embedding(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), torch.tensor([0, 1], dtype=torch.int32),
                                 torch.zeros(4, 4), torch.zeros(4, 4)), "positions must be int64"),
    (lambda: ew.store_kv(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), torch.zeros(2, 4, 2, 8),
                         torch.zeros(2, 4, 2, 8), torch.tensor([0, 1])), "do not agree"),
])
def test_bad_arguments_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        call()
