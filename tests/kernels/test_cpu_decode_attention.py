"""The C decode attention (kernels/cpu/csrc/decode_attention.c, the CPU engine's path) against the torch
reference on shuffled paged caches whose unused slots hold poison, and its argument checks."""
import random
import re

import pytest
import torch

from kernels import dispatch, reference

from kernels.cpu import build as cpu_build
from kernels.cpu.decode_attention import decode_attention
from kernel_testutil import build_paged_cache, seed_for


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",  # 48: a size with no copy of its own
                         [(4, 4, 32), (9, 3, 64), (14, 2, 64), (8, 1, 128), (4, 1, 256), (6, 2, 48)])  # 256: Gemma 3's
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_matches_the_reference_on_a_shuffled_cache(num_heads, num_kv_heads, head_dim, block_size):
    rng = random.Random(seed_for("cpu-decode", num_heads, head_dim, block_size))
    lens = [1, block_size + 1, 3 * block_size - 1] + [rng.randint(1, 300) for _ in range(13)]
    gen = torch.Generator().manual_seed(seed_for("cpu-decode-data", num_heads, block_size))
    k_cache, v_cache, tables = build_paged_cache(lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    expected = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("lens,block_size", [([1000], 16), ([997, 3], 32), ([641], 1), ([129, 2000, 5], 16)])
def test_long_sequences_split_into_chunks_merge_to_the_reference(lens, block_size):
    """A few long sequences are cut into chunks that run in parallel and merge by their softmax
    statistics; the merge must give the one-pass result."""
    gen = torch.Generator().manual_seed(seed_for("cpu-decode-chunks", len(lens), block_size))
    k_cache, v_cache, tables = build_paged_cache(lens, block_size, 3, 64, torch.float32, gen)
    q = torch.randn(len(lens), 9, 64, generator=gen) * 3  # sharp softmaxes: chunk maxima differ
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    expected = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_a_sequence_of_no_tokens_attends_to_nothing():
    """The runner pads a step to a GEMM bucket with rows of empty sequences: their output is zero
    (nothing read, nothing NaN), and the real rows beside them are unchanged."""
    gen = torch.Generator().manual_seed(seed_for("cpu-decode-empty"))
    lens = [0, 0, 37, 0, 130]
    k_cache, v_cache, tables = build_paged_cache([max(n, 1) for n in lens], 16, 3, 64, torch.float32, gen)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    out = decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    real = [i for i, n in enumerate(lens) if n]
    assert torch.equal(out[[0, 1, 3]], torch.zeros(3, 9, 64))
    expected = reference.decode_attention(q[real], k_cache, v_cache, tables[real],
                                          torch.tensor([lens[i] for i in real], dtype=torch.int32), 0.125)
    torch.testing.assert_close(out[real], expected, atol=2e-6, rtol=1e-5)


def on_threads(threads: int, run):
    """run() with torch's (and so the kernels' OpenMP) thread count set to `threads`, then put back."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return run()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_result_does_not_depend_on_the_thread_count(threads):
    gen = torch.Generator().manual_seed(seed_for("cpu-decode-threads"))
    lens = [37, 5, 250, 16, 99]
    k_cache, v_cache, tables = build_paged_cache(lens, 16, 2, 64, torch.float32, gen)
    q = torch.randn(len(lens), 6, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    run = lambda: decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)  # noqa: E731
    assert torch.equal(on_threads(threads, run), on_threads(1, run))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (9, 3), (4, 1)])  # (4, 1): the query heads split
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_one_short_sequence_shares_its_heads_out_with_the_same_bits(num_heads, num_kv_heads, threads):
    """A batch-1 decode step's one chunk is cut by heads over the threads (decode_attention.c
    `heads_t`): each head's work is what one task does with all of them, so the result is the same bit for
    bit, and the reference's."""
    gen = torch.Generator().manual_seed(seed_for("cpu-decode-heads", num_heads, threads))
    lens = [77]
    k_cache, v_cache, tables = build_paged_cache(lens, 16, num_kv_heads, 64, torch.float32, gen)
    q = torch.randn(1, num_heads, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    run = lambda: decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)  # noqa: E731
    split = on_threads(threads, run)
    assert torch.equal(split, on_threads(1, run))
    expected = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(split, expected, atol=2e-6, rtol=1e-5)


def test_an_empty_batch():
    k_cache = torch.zeros(2, 16, 1, 8)
    out = decode_attention(torch.zeros(0, 2, 8), k_cache, k_cache, torch.zeros(0, 1, dtype=torch.int32),
                           torch.zeros(0, dtype=torch.int32), 1.0)
    assert out.shape == (0, 2, 8)


def _args(**over):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = build_paged_cache([20, 3], 16, 2, 8, torch.float32, gen)
    args = dict(q=torch.randn(2, 4, 8, generator=gen), k_cache=k_cache, v_cache=v_cache,
                block_tables=tables, seq_lens=torch.tensor([20, 3], dtype=torch.int32))
    args.update(over)
    return args


@pytest.mark.parametrize("over,message", [
    (dict(q=torch.zeros(2, 4, 8, dtype=torch.float16)), "q must be a contiguous CPU tensor of torch.float32"),
    (dict(q=torch.zeros(2, 4, 8, dtype=torch.float16), k_cache=torch.zeros(4, 16, 2, 8, dtype=torch.float16),
          v_cache=torch.zeros(4, 16, 2, 8, dtype=torch.float16)), "q must be a contiguous CPU tensor of torch.float32"),
    (dict(q=torch.zeros(2, 3, 8)), "num_heads 3 must be a multiple of num_kv_heads 2"),
    (dict(q=torch.zeros(2, 4, 16)), "q head_dim 16 != cache head_dim 8"),
    (dict(seq_lens=torch.tensor([20, 3])), "seq_lens must be int32"),
    (dict(seq_lens=torch.tensor([20, 999], dtype=torch.int32)), "seq_lens (the table holds 4 blocks of 16) must lie in [0, 65); got [20, 999]"),
    (dict(block_tables=torch.full((2, 4), 10_000, dtype=torch.int32)), "block ids must lie in"),
    (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), "block_tables must be int32 [2, MB]"),
])
def test_bad_arguments_are_refused_by_name(over, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        decode_attention(**_args(**over), scale=1.0)


def test_the_build_is_cached_and_keyed_by_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    first = cpu_build.build("decode_attention")
    assert first.parent == tmp_path / "cpu_kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_build.build("decode_attention") == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setattr(cpu_build, "COMPILE_FLAGS", cpu_build.COMPILE_FLAGS + ["-DINFLIGHT_TEST_KEY"])
    assert cpu_build.build("decode_attention") != first


def test_without_a_compiler_the_engine_keeps_the_torch_reference(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_build, "load", cpu_build.load.__wrapped__)  # no cached library
    with pytest.raises(cpu_build.CpuKernelUnavailable):
        cpu_build.build("decode_attention")
    assert dispatch.cpu_ops(torch.float32) is dispatch.TORCH_OPS
    assert "using the torch reference" in caplog.text


def test_auto_on_cpu_uses_the_c_kernel_for_float32_only():
    cpu = torch.device("cpu")
    assert dispatch.get_ops("auto", cpu, torch.float32).decode_attention is decode_attention
    assert dispatch.get_ops("auto", cpu, torch.bfloat16) is dispatch.TORCH_OPS
    assert dispatch.get_ops("torch", cpu, torch.float32) is dispatch.TORCH_OPS
