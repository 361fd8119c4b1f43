"""The AMX build of the prefill attention (kernels/cpu/csrc/prefill_attention_amx.h: bfloat16 caches
on AMX's bfloat16 tiles) against the torch reference (SDPA on each chunk's gathered context in
float32). The tiles multiply bfloat16 pairs into float32 sums; K and V are bfloat16 already, and the
queries and probabilities go in as two bfloat16 each (hi + lo), so the result is float32's but for
~2^-16 of each query and weight and the order of the sums: TOL, ~100x looser than the float32
kernel's and ~100x tighter than what one bfloat16 rounding of the queries or the weights gives
(a lost `lo`, a wrong mask or rescale, a garbage key show as 1e-2 or more). Also: the tiles ran (a
call counter), a row's result does not depend on how its prompt was chunked, on the other sequences
of its call or on the thread count, NaN in the cache's unused slots stays out, and head sizes the
tiles do not take keep the float32 kernel. Runs where this CPU lists AMX-BF16 and the build's probe
was not refused the tiles; elsewhere there are no tiles to test."""
import ctypes

import pytest
import torch

from kernels import reference
from kernels.cpu import build as cpu_build
from kernels.cpu import prefill_attention as cpu_prefill
from kernel_testutil import seed_for
from test_cpu_prefill_attention import step



def no_tiles() -> str:
    """Why there are no tiles to test here ("" where there are): the CPU does not list AMX-BF16, or
    the build's probe was refused the tiles (PROBE_REFUSED) or killed for running them (SIGILL). A probe that
    crashed otherwise or computed a wrong sum, or a build that does not compile, is the kernel's
    fault: its tests run and fail."""
    missing = [f for f in cpu_prefill.AMX_NEEDS if f not in cpu_build._cpu_flags().split()]
    if missing:
        return f"this CPU does not list {', '.join(missing)}"
    ran, why = cpu_prefill._probe_runs(cpu_prefill.AMX_BUILD)
    refused = f"computed {cpu_prefill.PROBE_REFUSED}," in why or "exit status -4:" in why  # SIGILL: killed for them
    return why if not ran and refused else ""


pytestmark = pytest.mark.skipif(bool(no_tiles()), reason="no AMX tiles to test here")

TOL = dict(atol=1e-4, rtol=1e-4)  # measured: 1.4-2.0e-5 at most on these shapes (outputs up to ~3.7)


def amx_calls() -> int:
    return cpu_build.function(cpu_prefill.NAME, "amx_attention_calls", (), cpu_prefill.AMX_BUILD,
                              restype=ctypes.c_int64)()


def check(args, window=0):
    scale = args[0].shape[2] ** -0.5
    before = amx_calls()
    got = cpu_prefill.prefill_attention(*args, scale, window=window)
    assert amx_calls() == before + 1  # on the tiles
    torch.testing.assert_close(got, reference.prefill_attention(*args, scale, window=window), **TOL)
    return got


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (16, 8, 128), (8, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("block_size", [1, 16, 24, 32])  # 24: key blocks of 32 start part way into a cache block
def test_matches_the_reference_on_a_shuffled_cache(heads, kv_heads, head_dim, block_size):
    # a whole prompt, a chunk after cached context, a one-token chunk, chunks across key blocks of 256
    lens, q_lens = [37, 150, 9, 600, 300], [37, 33, 1, 270, 300]
    check(step(lens, q_lens, heads, kv_heads, head_dim, block_size,
               seed_for("cpu-prefill-amx", heads, head_dim, block_size), cache_dtype=torch.bfloat16))


@pytest.mark.parametrize("window", [1, 13, 100, 256, 300, 1000])
def test_a_sliding_window(window):
    """Gemma 3's local layers: windows shorter than a row block's keys, as long as a key block,
    across key blocks, and longer than the context."""
    check(step([37, 700, 90], [37, 400, 1], 8, 2, 64, 16, seed_for("cpu-prefill-amx-window", window),
               cache_dtype=torch.bfloat16), window=window)


def test_a_row_does_not_depend_on_its_chunk_or_the_thread_count():
    """The same 530 prompt tokens in one chunk, as chunks of 200 and 330 (the second after cached
    context) and as 17 + 513 in one call with other sequences: every row bit for bit alike."""
    q, k_cache, v_cache, tables, _, lens = step([530], [530], 9, 3, 64, 16, seed_for("cpu-prefill-amx-chunks"),
                                               cache_dtype=torch.bfloat16)
    scale = 0.125
    whole = cpu_prefill.prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, 530], dtype=torch.int32),
                                          lens, scale)
    first = cpu_prefill.prefill_attention(q[:200], k_cache, v_cache, tables, torch.tensor([0, 200], dtype=torch.int32),
                                          torch.tensor([200], dtype=torch.int32), scale)
    second = cpu_prefill.prefill_attention(q[200:], k_cache, v_cache, tables,
                                           torch.tensor([0, 330], dtype=torch.int32), lens, scale)
    assert torch.equal(torch.cat([first, second]), whole)
    both = torch.cat([q[:17], q[17:]])
    two = torch.tensor([[*tables[0].tolist()], [*tables[0].tolist()]], dtype=torch.int32)
    split = cpu_prefill.prefill_attention(both, k_cache, v_cache, two, torch.tensor([0, 17, 530], dtype=torch.int32),
                                          torch.tensor([17, 530], dtype=torch.int32), scale)
    assert torch.equal(split[:17], whole[:17])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_prefill.prefill_attention(q, k_cache, v_cache, tables, torch.tensor([0, 530], dtype=torch.int32),
                                            lens, scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, whole)
    # a local layer's window too: its key blocks still start at multiples of 256, whatever the chunk's first key
    cu = torch.tensor([0, 530], dtype=torch.int32)
    whole = cpu_prefill.prefill_attention(q, k_cache, v_cache, tables, cu, lens, scale, window=300)
    tail = cpu_prefill.prefill_attention(q[417:], k_cache, v_cache, tables, torch.tensor([0, 113], dtype=torch.int32),
                                         lens, scale, window=300)
    assert torch.equal(tail, whole[417:])


def amx_splits() -> int:
    return cpu_build.function(cpu_prefill.NAME, "amx_attention_splits", (), cpu_prefill.AMX_BUILD,
                              restype=ctypes.c_int64)()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("window", [0, 300, 700])
def test_a_short_chunk_at_a_long_context_splits_its_keys_with_the_same_bits(heads, kv_heads, head_dim, window):
    """A short chunk after a long context is few (tile, kv head) tasks, so its key parts (512 keys from
    key 0) are tasks of their own, folded afterwards (a paced prompt's chunk beside decode steps): the
    9 and 1 last tokens of 1,300, each chunk alone, give the rows of the whole prompt in one chunk bit
    for bit (each row's parts fold in the same order either way) and match the reference; so do 40
    tokens after 520 (two parts), under windows whose first key falls in each part."""
    args = step([1300, 560], [1300, 560], heads, kv_heads, head_dim, 16,
                seed_for("cpu-prefill-amx-split", heads, head_dim, window), cache_dtype=torch.bfloat16)
    q, k_cache, v_cache, tables, _, lens = args
    scale = head_dim ** -0.5
    whole = check(args, window=window)
    for s, row0, n in ((0, 0, 9), (0, 0, 1), (1, 1300, 40)):
        at = row0 + int(lens[s]) - n
        before = amx_splits()
        part = cpu_prefill.prefill_attention(q[at:at + n], k_cache, v_cache, tables[s:s + 1],
                                             torch.tensor([0, n], dtype=torch.int32), lens[s:s + 1], scale,
                                             window=window)
        assert amx_splits() == before + 1  # each spans two or three parts, under every window here
        assert torch.equal(part, whole[at:at + n])


def test_nan_in_the_unused_slots_stays_out():
    """A cache's unused slots hold whatever was there (torch.empty): the key blocks' tiles past a
    sequence's last key are zeros, not the slots' contents, since 0 x NaN is NaN."""
    q, k_cache, v_cache, tables, cu, lens = step([100, 40], [100, 7], 8, 2, 64, 16,
                                                 seed_for("cpu-prefill-amx-nan"), cache_dtype=torch.bfloat16)
    expected = cpu_prefill.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for s, n in enumerate(lens.tolist()):
        for t in range(n):
            used[int(tables[s, t // 16]), t % 16] = True
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")
    assert torch.equal(cpu_prefill.prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125), expected)


def test_head_sizes_the_tiles_do_not_take_keep_the_float32_kernel():
    args = step([130, 45], [77, 45], 6, 2, 48, 16, seed_for("cpu-prefill-amx-48"), cache_dtype=torch.bfloat16)
    before = amx_calls()
    got = cpu_prefill.prefill_attention(*args, 48 ** -0.5)
    assert amx_calls() == before
    torch.testing.assert_close(got, reference.prefill_attention(*args, 48 ** -0.5), atol=3e-6, rtol=1e-5)


def test_float32_caches_keep_the_float32_kernel():
    args = step([300], [300], 8, 2, 64, 16, seed_for("cpu-prefill-amx-f32"))
    before = amx_calls()
    got = cpu_prefill.prefill_attention(*args, 0.125)
    assert amx_calls() == before
    torch.testing.assert_close(got, reference.prefill_attention(*args, 0.125), atol=3e-6, rtol=1e-5)


def test_the_probe_runs_the_tiles_here():
    assert cpu_prefill._probe_runs(cpu_prefill.AMX_BUILD) == (True, "")


def test_a_build_without_amx_keeps_it_off(monkeypatch):
    monkeypatch.setenv("INFLIGHT_CPU_ISA", "avx512_vnni")
    cpu_prefill.amx_build.cache_clear()
    try:
        assert cpu_prefill.amx_build() is None
    finally:
        cpu_prefill.amx_build.cache_clear()
