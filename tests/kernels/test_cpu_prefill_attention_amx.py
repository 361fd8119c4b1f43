"""The AMX build of the prefill attention (kernels/cpu/csrc/prefill_attention_amx.h: bfloat16 caches
on AMX's bfloat16 tiles) against its oracle, `tiles_reference` below: the same computation in
torch, with the kernel's roundings (the scaled queries and each key block's probabilities rounded to
bfloat16, the running max and sum updated once per AKB = 256 keys from position 0) and float32
everywhere else, so the two differ only by the order of float32 sums, and where a probability that
lies near a rounding boundary is rounded the other way (a few outputs in ten thousand). Against the float32-exact reference the kernel is ~2^-9 off; a wrong mask, a lost
rescale or a garbage key shows as 1e-2 or more. Also: the tiles ran (a call counter), a row's result
does not depend on how its prompt was chunked nor on the thread count, poison in the cache's unused
slots stays out, and head sizes the tiles do not take keep the float32 kernel. Runs where this CPU
lists AMX-BF16 and the build's probe ran in a child process; elsewhere there are no tiles to test."""
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

AKB = 256  # prefill_attention_amx.h: keys a block
TOL = dict(atol=2e-4, rtol=2e-4)  # float32 sums in another order
FLIPS = 1e-3  # the share of outputs past TOL: those of a probability rounded the other way
FLIP_ATOL = 5e-3  # one such flip of a large weight: ~2^-9 of it times |v|


def amx_calls() -> int:
    return cpu_build.function(cpu_prefill.NAME, "amx_attention_calls", (), cpu_prefill.AMX_BUILD,
                              restype=ctypes.c_int64)()


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def tiles_reference(q, k_cache, v_cache, tables, cu, lens, scale, window=0):
    """What the tiles compute, row by row, in float32 torch ops."""
    out = torch.zeros_like(q)
    _, bs, kv_heads, _ = k_cache.shape
    rep = q.shape[1] // kv_heads
    for s in range(lens.shape[0]):
        n, rows = int(lens[s]), slice(int(cu[s]), int(cu[s + 1]))
        qlen = rows.stop - rows.start
        slots = [int(tables[s, t // bs]) * bs + t % bs for t in range(n)]
        k = k_cache.flatten(0, 1)[slots].float()  # [n, G, D]
        v = v_cache.flatten(0, 1)[slots].float()
        pos = torch.arange(n - qlen, n)[:, None]
        keys = torch.arange(n)[None, :]
        seen = (keys <= pos) & ((keys > pos - window) if window > 0 else True)  # [qlen, n]
        for h in range(q.shape[1]):
            g = h // rep
            scores = bf16(q[rows, h] * scale) @ k[:, g].T  # [qlen, n]
            m = torch.zeros(qlen)
            l = torch.zeros(qlen)
            acc = torch.zeros(qlen, q.shape[2])
            for b0 in range(0, n, AKB):
                blk = slice(b0, min(b0 + AKB, n))
                sb, mask = scores[:, blk], seen[:, blk]
                has = mask.any(1)
                top = torch.where(mask, sb, torch.tensor(-torch.inf)).amax(1)
                first = l == 0
                new_m = torch.where(first | (top > m), top, m)
                keep = torch.where(first, torch.zeros(()), torch.exp(m - new_m))
                p = bf16(torch.where(mask, torch.exp(sb - new_m[:, None]), torch.zeros(())))
                keep = torch.where(has, keep, torch.ones(()))
                l = torch.where(has, l * keep + p.sum(1), l)
                m = torch.where(has, new_m, m)
                acc = acc * keep[:, None] + p @ v[blk, g]
            out[rows, h] = acc / l[:, None]
    return out


def check(args, window=0):
    scale = args[0].shape[2] ** -0.5
    before = amx_calls()
    got = cpu_prefill.prefill_attention(*args, scale, window=window)
    assert amx_calls() == before + 1  # on the tiles
    expected = tiles_reference(*args, scale, window=window)
    off = ~torch.isclose(got, expected, **TOL)
    assert off.float().mean() <= FLIPS, f"{int(off.sum())} of {off.numel()} outputs off"
    torch.testing.assert_close(got, expected, atol=FLIP_ATOL, rtol=0)
    # and ~2^-9 from the float32 computation, not further
    torch.testing.assert_close(got, reference.prefill_attention(*args, scale, window=window), atol=3e-2, rtol=3e-2)
    return got


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (16, 8, 128), (8, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_matches_the_tiles_oracle_on_a_shuffled_cache(heads, kv_heads, head_dim, block_size):
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
