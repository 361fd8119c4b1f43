"""`attention_backend=torch` on a GPU: the references must not read device values on the host in
a layer (boolean-mask indexing, .tolist(), .item() each stall the host until the GPU catches up,
every layer of every step). On the CPU such reads are free, so there the references keep their
host-side grouping; `reference.host_reads_are_free` tells them apart, and the tests below make it
say "no" to run the GPU branch on CPU tensors, with every device read made to raise, and check it
against the CPU branch."""
import contextlib
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import reference
from kernel_testutil import build_paged_cache, seed_for

aten = torch.ops.aten
# Operators whose output size depends on tensor values: on a GPU they copy a count to the host.
DATA_DEPENDENT = {aten.nonzero, aten.masked_select, aten._local_scalar_dense, aten.unique_consecutive,
                  aten._unique2, aten.unique_dim, aten.masked_scatter, aten.repeat_interleave}


class NoDeviceReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in DATA_DEPENDENT:
            raise AssertionError(f"{func} reads device values on the host")
        if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                raise AssertionError(f"{func} with a boolean mask reads device values on the host")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def gpu_branch():
    """The references take their GPU branch, and any host read of a tensor raises."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "host_reads_are_free", lambda t: False)

        def refuse(name):
            def method(self, *a, **k):
                raise AssertionError(f"Tensor.{name} reads device values on the host")
            return method

        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
            mp.setattr(torch.Tensor, name, refuse(name))
        with NoDeviceReads():
            yield


def test_the_detector_catches_what_the_cpu_branch_does(monkeypatch):
    """The old store_kv (boolean mask) and the CPU branch of decode attention (.tolist()) trip it."""
    slots = torch.tensor([3, -1, 5])
    cache = torch.zeros(2, 4, 1, 2)
    with pytest.raises(AssertionError, match="boolean mask"):
        with NoDeviceReads():
            cache.view(8, 1, 2)[slots[slots >= 0]] = 1.0
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (_ for _ in ()).throw(AssertionError("tolist")))
    with pytest.raises(AssertionError, match="tolist"):
        reference.decode_attention(torch.zeros(1, 2, 2), cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                                   torch.tensor([3], dtype=torch.int32), 1.0)


def _store_case(seed, t, g=2, d=8, nb=6, bs=4, skip=0.3):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    key, value = torch.randn(t, g, d, generator=gen), torch.randn(t, g, d, generator=gen)
    slots = torch.tensor(rng.sample(range(nb * bs), t))
    slots[torch.rand(t, generator=gen) < skip] = -1
    return key, value, torch.randn(nb, bs, g, d, generator=gen), torch.randn(nb, bs, g, d, generator=gen), slots


def _store_expected(key, value, k_cache, v_cache, slots):
    k, v = k_cache.clone(), v_cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            k.view(-1, *k.shape[2:])[s] = key[i]
            v.view(-1, *v.shape[2:])[s] = value[i]
    return k, v


@pytest.mark.parametrize("seed,t,skip", [(0, 9, 0.3), (1, 1, 0.0), (2, 7, 1.0), (3, 12, 0.5), (4, 5, 0.0)])
def test_store_kv_skips_slot_minus_one_without_reading_the_slots(seed, t, skip):
    key, value, k_cache, v_cache, slots = _store_case(seed, t, skip=skip)
    slots[0] = -1 if skip else slots[0]   # a skipped row before any stored one
    want = _store_expected(key, value, k_cache, v_cache, slots)
    mode = NoDeviceReads()
    with mode:
        reference.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want[0]) and torch.equal(v_cache, want[1])


@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_gpu_branch_matches_the_cpu_branch(block_size):
    rng = random.Random(seed_for("sync-decode", block_size))
    lens = [1, 2, 17] + [rng.randint(1, 200) for _ in range(9)]
    gen = torch.Generator().manual_seed(seed_for("sync-decode-data", block_size))
    k_cache, v_cache, tables = (t.cpu() for t in build_paged_cache(lens, block_size, 2, 16, torch.float32, gen))
    q = torch.randn(len(lens), 8, 16, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2)
    with gpu_branch():
        got = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, max_seq_len=max(lens))
        got_bound = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2)   # the table's bound
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_bound, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_gpu_branch_matches_the_cpu_branch(block_size):
    q_lens, ctx = [5, 1, 33, 17], [0, 40, 7, 0]      # fresh prompts, one token after context, a chunk
    seq = [a + b for a, b in zip(q_lens, ctx)]
    gen = torch.Generator().manual_seed(seed_for("sync-prefill", block_size))
    k_cache, v_cache, tables = (t.cpu() for t in build_paged_cache(seq, block_size, 2, 16, torch.float32, gen))
    q = torch.randn(sum(q_lens), 8, 16, generator=gen)
    cu = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    want = reference.prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.2)
    with gpu_branch():
        got = reference.prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.2, max_q_len=max(q_lens))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
