"""The C prefill attention (kernels/cpu/csrc/prefill_attention.c: the prompt rows of the CPU engine's
steps, in the C layer stack and the Python layers) against the torch reference (SDPA on each
chunk's gathered context), on shuffled paged caches whose unused slots hold poison: several
sequences with different cached lengths in one call (a first chunk, a later chunk after cached
context, a one-token chunk), lengths that are not block multiples, sliding windows, GQA groups,
bfloat16 caches, every build this CPU runs; and its argument checks."""
import random
import re

import pytest
import torch

from kernels import dispatch, reference
from kernels.cpu import build as cpu_build
from kernels.cpu import prefill_attention as cpu_prefill
from kernels.cpu import quant as cpu_quant
from kernels.cpu.prefill_attention import prefill_attention
from kernel_testutil import build_paged_cache, seed_for


def builds() -> list:
    """-march=native (None), and every named build this CPU runs (the portable one runs anywhere)."""
    flags = set(cpu_build._cpu_flags().split())
    return [None] + [isa for isa, needed in cpu_quant.NEEDS.items() if set(needed) <= flags] + ["portable"]


def step(lens, q_lens, heads, kv_heads, head_dim, block_size, seed, cache_dtype=torch.float32):
    """A step's prompt rows: sequence i has lens[i] cached tokens, the last q_lens[i] its chunk."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = build_paged_cache(lens, block_size, kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen) * 2  # sharp softmaxes: tiles' maxima differ
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q, k_cache.to(cache_dtype), v_cache.to(cache_dtype), tables, cu, torch.tensor(lens, dtype=torch.int32))


def check(args, window=0, isa=None):
    scale = args[0].shape[2] ** -0.5
    out = prefill_attention(*args, scale, window=window, isa=isa)
    expected = reference.prefill_attention(*args, scale, window=window)
    torch.testing.assert_close(out, expected, atol=3e-6, rtol=1e-5)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (14, 2, 64), (8, 1, 128), (6, 2, 48)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_matches_the_reference_on_a_shuffled_cache(heads, kv_heads, head_dim, block_size):
    rng = random.Random(seed_for("cpu-prefill", heads, head_dim, block_size))
    # a whole prompt, a chunk after 117 cached tokens, a one-token chunk, a chunk past a tile of keys
    lens, q_lens = [37, 150, 9, 200], [37, 33, 1, 70]
    lens.append(rng.randint(2, 150))
    q_lens.append(rng.randint(1, lens[-1]))
    check(step(lens, q_lens, heads, kv_heads, head_dim, block_size, seed_for("cpu-prefill-data", heads, block_size)))


@pytest.mark.parametrize("window", [1, 13, 64, 100, 500])
def test_a_sliding_window_reads_only_each_querys_last_positions(window):
    """Gemma 3's and Mistral's local layers: a window shorter than the context, longer than a tile,
    as long as a key tile, one token, and longer than everything (changes nothing)."""
    args = step([37, 230, 90], [37, 100, 1], 8, 2, 32, 16, seed_for("cpu-prefill-window", window))
    check(args, window=window)


def test_a_bfloat16_cache_is_widened_as_it_is_read(monkeypatch):
    """The float32 kernel's (where AMX-BF16 runs, bfloat16 caches take the tiles by default:
    test_cpu_prefill_attention_amx.py)."""
    monkeypatch.setattr(cpu_prefill, "amx_build", lambda: None)
    args = step([70, 300], [70, 45], 9, 3, 64, 16, seed_for("cpu-prefill-bf16"), cache_dtype=torch.bfloat16)
    check(args, window=0)
    check(args, window=50)


@pytest.mark.parametrize("isa", builds())
def test_every_build_matches_the_reference(isa):
    check(step([130, 45, 17], [130, 20, 17], 9, 3, 64, 16, seed_for("cpu-prefill-isa")), window=0, isa=isa)
    check(step([130], [77], 8, 2, 128, 16, seed_for("cpu-prefill-isa-128")), window=40, isa=isa)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_result_does_not_depend_on_the_thread_count(threads):
    args = step([300, 40], [200, 40], 6, 2, 64, 16, seed_for("cpu-prefill-threads"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefill_attention(*args, 0.125)
        torch.set_num_threads(threads)
        assert torch.equal(prefill_attention(*args, 0.125), one)
    finally:
        torch.set_num_threads(before)


# Short chunks at long contexts: few (tile, kv head) tasks, so their keys are split into parts
# (prefill_attention.c, key_parts: fewer than 16 tasks and at least 2 x 256 keys), merged after.
SPLIT = dict(lens=[1300, 700, 560, 90], q_lens=[9, 1, 40, 90])


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (4, 4, 32), (6, 2, 48)])
@pytest.mark.parametrize("window", [0, 300, 700])
def test_short_chunks_at_long_contexts_split_their_keys_and_match_the_reference(heads, kv_heads, head_dim, window):
    """The split's parts (and the rows of a part that see none of its keys, under a window) merge to
    the whole softmax: the reference sees every chunk whole."""
    args = step(SPLIT["lens"], SPLIT["q_lens"], heads, kv_heads, head_dim, 16,
                seed_for("cpu-prefill-split", heads, head_dim, window))
    check(args, window=window)


@pytest.mark.parametrize("isa", builds())
def test_every_build_splits_alike(isa):
    check(step(SPLIT["lens"], SPLIT["q_lens"], 9, 3, 64, 16, seed_for("cpu-prefill-split-isa")), isa=isa)


def test_a_split_sequence_does_not_depend_on_its_neighbours_or_the_thread_count():
    """The parts are chosen from a sequence's own shape: the 9-token chunk at 1,300 tokens gives the
    same bits alone, beside other sequences, on one thread or two."""
    args = step(SPLIT["lens"], SPLIT["q_lens"], 9, 3, 64, 16, seed_for("cpu-prefill-split-alone"))
    q, k_cache, v_cache, tables, cu, lens = args
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = prefill_attention(*args, 0.125)
        torch.set_num_threads(2)
        assert torch.equal(prefill_attention(*args, 0.125), together)
        alone = prefill_attention(q[:9], k_cache, v_cache, tables[:1], cu[:2], lens[:1], 0.125)
        assert torch.equal(alone, together[:9])
    finally:
        torch.set_num_threads(before)


def test_no_prompt_rows():
    k_cache = torch.zeros(2, 16, 1, 8)
    out = prefill_attention(torch.zeros(0, 2, 8), k_cache, k_cache, torch.zeros(0, 1, dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 1.0)
    assert out.shape == (0, 2, 8)


def _args(**over):
    q, k_cache, v_cache, tables, cu, lens = step([20, 3], [5, 3], 4, 2, 8, 16, 1)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, cu_seqlens_q=cu, seq_lens=lens)
    args.update(over)
    return args


@pytest.mark.parametrize("over,message", [
    (dict(q=torch.zeros(8, 4, 8, dtype=torch.float16)), "q must be a contiguous CPU tensor of torch.float32"),
    (dict(q=torch.zeros(8, 3, 8)), "num_heads 3 must be a multiple of num_kv_heads 2"),
    (dict(q=torch.zeros(8, 4, 16)), "q head_dim 16 != cache head_dim 8"),
    (dict(seq_lens=torch.tensor([20, 3])), "seq_lens must be int32"),
    (dict(seq_lens=torch.tensor([20, 999], dtype=torch.int32)),
     "seq_lens (the table holds 4 blocks of 16) must lie in [0, 65); got [20, 999]"),
    (dict(seq_lens=torch.tensor([20, 2], dtype=torch.int32)), "a chunk is longer than its sequence's seq_lens"),
    (dict(block_tables=torch.full((2, 4), 10_000, dtype=torch.int32)), "block ids must lie in"),
    (dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)), "block_tables must be contiguous int32 [.., 2, MB]"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 9], dtype=torch.int32)), "cu_seqlens_q must rise from 0 to the 8 query rows"),
    (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)), "cu_seqlens_q must be int32 [3]"),
])
def test_bad_arguments_are_refused_by_name(over, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        prefill_attention(**_args(**over), scale=1.0)


def test_auto_on_cpu_runs_it_for_the_prompt_rows():
    assert dispatch.get_ops("auto", torch.device("cpu"), torch.float32).prefill_attention is prefill_attention
