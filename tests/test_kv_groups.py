"""KV-cache groups (backend/kv/groups.py): the layout of a model's layers into groups, local groups
giving back the blocks that left the window, what a sequence may hold, prefix hits every group
accepts, the n completions' sharing; a hypothesis state machine of sequences over three groups
checked against a fake cache's contents, and the same with a fake KV tier taking every block handed
out (the tiered hit: backend/kv/tiers/grouped.py); and the engine on a tiny Gemma 3 whose request fits only
because its local layers keep their window alone, token for token with transformers."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from backend.kv.block_pool import NULL_BLOCK, block_hashes
from backend.kv.groups import KVCacheGroups, kv_layout
from backend.kv.tiers.grouped import GroupListener, tiered_hit


# -- layout ---------------------------------------------------------------------------------------

def test_layouts_of_the_architectures():
    llama = kv_layout((), 4)
    assert (llama.group_windows, llama.slots, llama.layer_slot) == ((0,), 4, (0, 1, 2, 3))
    gemma_270m = kv_layout(tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18)), 18)
    assert gemma_270m.group_windows == (0, 512, 512, 512, 512, 512) and gemma_270m.slots == 3
    assert [gemma_270m.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [gemma_270m.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    assert gemma_270m.layer_group[:5] == (1, 1, 1, 2, 2) and gemma_270m.layer_slot[:5] == (0, 1, 2, 0, 1)
    gemma_1b = kv_layout(tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26)), 26)   # 4 global, 22 local
    assert gemma_1b.group_windows == (0,) + (512,) * 6 and gemma_1b.slots == 4      # the last local group: 2
    mistral = kv_layout((4096,) * 4, 4)
    assert (mistral.group_windows, mistral.slots) == ((4096,), 4)
    for layout in (gemma_270m, gemma_1b):   # every (group, slot) names one layer
        assert len(set(zip(layout.layer_group, layout.layer_slot))) == len(layout.layer_group)


# -- one sequence's blocks ------------------------------------------------------------------------

def test_a_local_group_gives_back_what_left_the_window():
    kv = KVCacheGroups(64, 4, (0, 6), max_prefill_tokens=8, max_decode_tokens=1)
    kv.grow("a", 13)                        # 4 blocks in each group
    assert kv.num_used_blocks == 8
    assert kv.slide("a", 13) == 2           # position 13 sees 8..13: blocks 0 and 1 (0..7) are out
    full, local = kv.block_tables("a")
    assert len(full) == 4 and NULL_BLOCK not in full
    assert local[:2] == [NULL_BLOCK] * 2 and NULL_BLOCK not in local[2:]
    assert kv.num_used_blocks == 6 and kv.num_blocks_of("a") == 6
    assert kv.slide("a", 13) == 0           # nothing more until the window moves
    kv.grow("a", 17)
    assert kv.slide("a", 17) == 1 and kv.block_tables("a")[1][:3] == [NULL_BLOCK] * 3
    kv.check_integrity()
    kv.free("a")
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def test_what_a_sequence_may_hold_is_capped_by_its_window_and_its_steps():
    kv = KVCacheGroups(10_000, 16, (0, 512), max_prefill_tokens=2048, max_decode_tokens=1)
    # the global group all 8192 tokens; the local one the window and a 2048-token chunk at most
    assert kv.blocks_for(8192) == 512 + (-(-(511 + 2048 - 1) // 16) + 1)
    assert kv.blocks_for(8192, decoding=True) == 512 + 33   # 512 tokens lie in at most 33 blocks
    assert kv.blocks_for(100) == 7 + 7                      # shorter than the window: all of it


def test_the_prefix_hit_is_the_longest_every_group_accepts():
    """A local group needs the blocks its window reaches before the hit point; the global one the
    whole run from the start. Here the second request's local layers lost the first blocks of the
    prefix (given back and handed out again), so only a hit whose window lies after them counts."""
    kv = KVCacheGroups(24, 2, (0, 4), enable_prefix_caching=True, max_prefill_tokens=20)
    tokens = list(range(10, 30))
    kv.grow("a", 20)
    kv.register_computed("a", tokens, 20)
    kv.slide("a", 20)          # the local group keeps blocks 8 and 9 (positions 16..19) of 10
    hashes = block_hashes(tokens, 2, 19)      # the 9 whole blocks before the last token
    assert kv.prefix_hit(hashes) == 9         # its window (blocks 7, 8) is still cached
    kv.free("a")
    kv.grow("b", 10)                          # takes free blocks: the least recently freed first
    hit = kv.prefix_hit(hashes)
    assert 2 <= hit < 9
    local = kv.groups[1]
    assert all(h in local._cached for h in hashes[hit - local.window_blocks():hit])
    assert kv.reuse_prefix("c", hashes=hashes) == hit * 2
    full, window = kv.block_tables("c")
    assert NULL_BLOCK not in full and window[:hit - 2] == [NULL_BLOCK] * (hit - 2)
    kv.check_integrity()


def test_the_n_completions_share_a_prompt_only_while_its_window_is_held():
    kv = KVCacheGroups(40, 4, (0, 5), max_prefill_tokens=16)
    kv.grow("first", 13)
    assert kv.fork("first", "second", 12) == 12          # nothing slid yet: the 3 whole blocks
    assert kv.block_tables("second")[1] == kv.block_tables("first")[1][:3]
    kv.free("second")
    kv.slide("first", 13)                       # position 13 sees 9..: blocks 0 and 1 go back
    assert kv.fork("first", "third", 12) == 12  # position 12 sees 8..12: block 2, still held
    kv.free("third")
    kv.grow("first", 18)
    kv.slide("first", 18)                       # position 18 sees 14..: block 2 (8..11) goes back too
    assert kv.fork("first", "fourth", 12) == 0
    assert kv.block_tables("fourth") == [[], []]
    kv.check_integrity()


# -- a state machine over three groups ------------------------------------------------------------

class GroupsMachine(RuleBasedStateMachine):
    """Sequences over a tiny alphabet, three groups (a global one and two local ones of different
    windows), block size 2. A fake cache records what each block holds, per group; a block a
    sequence takes from the cache must hold that prefix's tokens, and a local group must hold each
    sequence's whole window."""
    WINDOWS = (0, 3, 5)

    def __init__(self):
        super().__init__()
        self.kv = KVCacheGroups(40, 2, self.WINDOWS, enable_prefix_caching=True, max_prefill_tokens=12,
                                max_decode_tokens=3)
        self.contents: dict[tuple[int, int], tuple] = {}  # (group, block) -> (group, tokens written)
        self.active: dict[str, list[int]] = {}

    def _compute(self, seq, tokens, start):
        """Write the tokens from `start` on into every group's blocks, then publish and slide."""
        for g, table in enumerate(self.kv.block_tables(seq)):
            for i in range(start // 2, len(table)):
                if table[i] != NULL_BLOCK:
                    self.contents[(g, table[i])] = (g, tuple(tokens[2 * i:2 * i + 2]))
        self.kv.register_computed(seq, tokens, len(tokens))
        self.kv.slide(seq, len(tokens))
        self.active[seq] = tokens

    @rule(seq=st.sampled_from("abcde"), tokens=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=12))
    def start(self, seq, tokens):
        if seq in self.active:
            return
        reused = self.kv.reuse_prefix(seq, tokens)
        assert reused % 2 == 0 and reused < len(tokens)
        for g, table in enumerate(self.kv.block_tables(seq)):
            for i, block in enumerate(table):
                if block != NULL_BLOCK:
                    assert self.contents[(g, block)] == (g, tuple(tokens[2 * i:2 * i + 2])), "reused other tokens"
            window = self.WINDOWS[g]
            if window and reused:   # the blocks the next token's window reaches are there
                assert NULL_BLOCK not in table[max(0, reused - window + 1) // 2:]
        if not self.kv.can_grow(seq, len(tokens)):
            self.kv.free(seq)
            return
        self.kv.grow(seq, len(tokens))
        self._compute(seq, tokens, reused)

    @rule(seq=st.sampled_from("abcde"), more=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=3))
    def decode(self, seq, more):
        if seq not in self.active:
            return
        tokens = self.active[seq] + more
        if self.kv.can_grow(seq, len(tokens)):
            start = len(self.active[seq])
            self.kv.grow(seq, len(tokens))
            self._compute(seq, tokens, start - start % 2)

    @rule(seq=st.sampled_from("abcde"), child=st.sampled_from("vwxyz"))
    def fork(self, seq, child):
        if seq not in self.active or child in self.active:
            return
        tokens = self.active[seq]
        shared = self.kv.fork(seq, child, len(tokens) - 1)
        if shared:
            self.active[child] = tokens[:shared]

    @rule(seq=st.sampled_from("abcdevwxyz"))
    def finish(self, seq):
        self.kv.free(seq)
        self.active.pop(seq, None)

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        for seq, tokens in self.active.items():
            assert self.kv.num_blocks_of(seq) <= self.kv.blocks_for(len(tokens))
            for window, table in zip(self.WINDOWS, self.kv.block_tables(seq)):
                if window:   # a local group holds its window and at most a step's tokens more
                    assert NULL_BLOCK not in table[max(0, len(tokens) - window + 1) // 2:]


TestGroupsMachine = GroupsMachine.TestCase
TestGroupsMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class TieredGroupsMachine(GroupsMachine):
    """The same sequences on a small pool, so that cached blocks are handed out again; every block
    that leaves a group's prefix cache goes to a fake KV tier under that group's key (through the
    group listeners, as the engine wires them: backend/kv/tiers/grouped.py), with what it held (its
    group and tokens: a group's layers differ, so a block copied in from another group's entry
    shows). A sequence that starts takes its device prefix, then the hit the device's caches and the
    tier hold together, the tier's blocks copied in: every table entry must hold its prefix's tokens
    of its own group, and each local group the window of the position computation resumes at."""

    def __init__(self):
        super().__init__()
        self.tier: dict[bytes, tuple] = {}  # tier key -> what its block held
        machine = self

        class Recorder:
            def __init__(self, group):
                self.group = group

            def blocks_stored(self, blocks, keys, parent, root, token_ids):
                pass

            def blocks_removed(self, blocks, keys):
                for block, key in zip(blocks, keys):
                    machine.tier[key] = machine.contents[(self.group, block)]

            def cache_cleared(self):
                pass

        self.kv = KVCacheGroups(24, 2, self.WINDOWS, enable_prefix_caching=True, max_prefill_tokens=12,
                                max_decode_tokens=3, listeners=[Recorder(0)])
        for g in range(1, len(self.WINDOWS)):
            self.kv.groups[g].listeners.append(GroupListener(Recorder(g), g))

    @rule(seq=st.sampled_from("abcde"), tokens=st.lists(st.sampled_from([1, 2]), min_size=1, max_size=14))
    def start(self, seq, tokens):
        if seq in self.active:
            return
        hashes = block_hashes(tokens, 2, len(tokens) - 1)
        computed = self.kv.reuse_prefix(seq, hashes=hashes)
        hit = tiered_hit(self.kv, seq, hashes, computed // 2, lambda k: False if k in self.tier else None)
        # (admission's reservation sees to it that the blocks fit: those taken, and the cached ones held)
        if hit is not None and sum(e is None or (e != NULL_BLOCK and self.kv.ref_count(e) == 0)
                                   for g in hit.entries for e in g) <= len(self.kv.pool.free):
            assert hit.start == computed // 2 < hit.end <= len(hashes)
            taken = self.kv.attach(seq, hit.entries)
            keys = iter(hit.keys)
            for i in range(hit.end - hit.start):  # the copies, in the hit's order: position, then group
                for g in range(len(self.WINDOWS)):
                    if hit.entries[g][i] is None:
                        self.contents[(g, taken[g].pop(0))] = self.tier[next(keys)]
            assert next(keys, None) is None and not any(taken)
            computed = hit.end * 2
        for g, table in enumerate(self.kv.block_tables(seq)):
            for i, block in enumerate(table):
                if block != NULL_BLOCK:
                    assert self.contents[(g, block)] == (g, tuple(tokens[2 * i:2 * i + 2])), "another block's KV"
            if self.WINDOWS[g] and computed:  # the blocks the next token's window reaches are there
                assert NULL_BLOCK not in table[max(0, computed - self.WINDOWS[g] + 1) // 2:]
        self.kv.check_integrity()
        if not self.kv.can_grow(seq, len(tokens)):
            self.kv.free(seq)
            return
        self.kv.grow(seq, len(tokens))
        self._compute(seq, tokens, computed)


TestTieredGroupsMachine = TieredGroupsMachine.TestCase
TestTieredGroupsMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


# -- the engine: a request that fits only because local layers keep their window -----------------

@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from hf_checkpoints import make_checkpoint
    return make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3-kv"), seed=11)


def test_a_long_request_fits_because_the_local_layers_slide(gemma):
    """The tiny Gemma 3 (a global layer, two local ones of window 13): 420 tokens in every layer
    would take 27 blocks per layer, 81 in all; its groups hold the global layer's 27 and each local
    layer's window and chunk, so 35 pool blocks serve it, every step within them, no-evict admits
    it, and its tokens are transformers'."""
    from backend import LLM, SamplingParams
    from hf_checkpoints import hf_greedy
    rng = random.Random(1)
    prompt = [rng.randrange(3, 512) for _ in range(400)]
    expected = hf_greedy(gemma, [prompt], [20])[0]
    llm = LLM(str(gemma), kv_block_size=16, max_tokens_in_paged_kv_cache=192, max_num_batched_tokens=32)
    engine = llm.engine
    assert (engine.blocks.num_blocks, engine.runner.kv_layout.slots) == (36, 1)   # 192 tokens x 3 layers
    assert engine.blocks.blocks_for(420) == 27 + 2 * 4 <= 36
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    peak, reserved, out = 0, [], []
    while engine.has_work():
        for o in engine.step():
            out = o.token_ids
        stats = llm.stats()
        peak = max(peak, stats["kv_blocks_used"])
        reserved.append(stats["kv_blocks_reserved"])
    assert out == expected
    assert peak <= 35
    # the reservation falls once the prompt is computed: the local groups then hold 2 blocks each
    assert reserved[0] == 27 + 2 * 4 and min(r for r in reserved if r) == 27 + 2 * 2
    assert llm.stats()["kv_blocks_used"] == 0
    llm.check_integrity()


def test_the_cache_figure_of_one_8k_request():
    """client/tools/benchmarks/kv_cache_figure.py (docs/performance.md): a Gemma-3-270M-shaped model (18 layers,
    five local of window 512 to each global) and a Llama of its dimensions, one request of 8,192
    tokens in chunks of 512. The Llama holds all 512 blocks in all 18 layers; the Gemma-shaped
    model its 3 global layers' 512 and, once decoding, 33 blocks in each of its 15 local layers
    (512 tokens span at most 33 blocks of 16); while prefilling, a local layer holds the window and
    a chunk: 65."""
    from client.tools.benchmarks.kv_cache_figure import figure
    result = figure(tokens=8192, window=512, layers=18, pattern=6, block_size=16, chunk=512, max_tokens=16)
    llama, gemma = result["layer_blocks"]["llama"], result["layer_blocks"]["gemma3"]
    assert llama["reserved_at_admission"] == llama["used_at_end"] == 18 * 512
    assert gemma["reserved_decoding"] == gemma["used_at_end"] == 3 * 512 + 15 * 33
    assert gemma["reserved_at_admission"] == 3 * 512 + 15 * 65
    assert gemma["used_peak"] <= gemma["reserved_at_admission"]
    assert result["gemma3_share"]["used_at_end"] == pytest.approx(1 / 6 + 5 / 6 * 33 / 512, abs=1e-3)


def test_the_gpu_warm_up_and_sizing_of_a_model_of_several_groups(gemma):
    """What a CUDA start runs before sizing the cache (backend/worker/runner.py's _warm_up): its steps, whose
    rows carry one table, on a throwaway cache through every group; and a pool block's bytes: a
    group's layers (one here), not the model's three."""
    from backend import LLM
    llm = LLM(str(gemma), attention_backend="torch", kv_block_size=16, max_num_batched_tokens=40, max_num_seqs=3)
    runner = llm.engine.runner
    cfg = runner.model_cfg
    per_layer_token = 2 * cfg.num_kv_heads * cfg.head_dim * runner.kv_dtype.itemsize
    assert runner._bytes_per_block() == 16 * per_layer_token * runner.kv_layout.slots == 16 * per_layer_token
    runner._warm_up()
    assert runner.kv_caches == [] and runner.batch.tables.table.abs().sum() == 0 and not runner.batch.seqs   # left as it found them


def test_drafts_and_the_n_completions_of_a_prompt_on_a_model_of_several_groups(gemma):
    """ngram speculation (a verify row of 1 + 4 tokens: the local groups reserve that) gives the
    plain engine's tokens; the n completions of a prompt, sharing it or computing it again when
    its window is gone, each give transformers' greedy tokens. No block is left held."""
    import json

    from backend import LLM, SamplingParams
    from hf_checkpoints import hf_greedy
    rng = random.Random(3)
    base = [rng.randrange(3, 60) for _ in range(30)]
    prompts = [base * 3, base[:17] * 4, [rng.randrange(3, 512) for _ in range(50)]]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = LLM(str(gemma), kv_block_size=16, max_tokens_in_paged_kv_cache=256).generate(prompts, params)
    spec = LLM(str(gemma), kv_block_size=16, max_tokens_in_paged_kv_cache=256, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}))
    assert spec.engine.blocks.groups[1].max_decode_tokens == 5
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0 and spec.stats()["kv_blocks_used"] == 0
    spec.check_integrity()
    expected = hf_greedy(gemma, prompts[2:], [12])[0]
    for reuse in (False, True):
        llm = LLM(str(gemma), kv_block_size=16, enable_kv_cache_reuse=reuse)
        outs = llm.generate(prompts[2:], SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True))
        assert [s.token_ids for s in outs[0].samples] == [expected] * 3
        assert llm.stats()["kv_blocks_used"] == 0
        llm.check_integrity()


def test_kv_cache_events_describe_the_first_group():
    """The KV-event listeners (backend/kv/events.py) hear the first group, a model's global layers:
    its stored and evicted keys, once; a local group's blocks, which come and go with the window,
    say nothing; reset_prefix_cache clears every group, only while nothing is held."""
    from backend.kv.block_manager import BlockListener

    class Recorder(BlockListener):
        def __init__(self):
            self.calls = []

        def blocks_stored(self, blocks, keys, parent, root, token_ids):
            self.calls.append(("stored", list(blocks), list(keys)))

        def blocks_removed(self, blocks, keys):
            self.calls.append(("removed", list(blocks), list(keys)))

        def cache_cleared(self):
            self.calls.append(("cleared",))

    kv = KVCacheGroups(12, 2, (0, 3), enable_prefix_caching=True, max_prefill_tokens=8)
    rec = Recorder()
    kv.listeners.append(rec)
    tokens = list(range(1, 9))
    kv.grow("a", 8)
    kv.register_computed("a", tokens, 8)
    kv.slide("a", 8)
    assert rec.calls == [("stored", kv.block_tables("a")[0], block_hashes(tokens, 2))]
    assert not kv.reset_prefix_cache()                    # "a" holds blocks
    first = kv.block_tables("a")[0]
    kv.free("a")
    kv.grow("b", 8)   # the 4 unused blocks, then the local group's given-back ones and a's last
    removed = [c for c in rec.calls if c[0] == "removed"]
    # of the cached blocks handed out again, only the first group's are heard: a's last block
    assert removed == [("removed", [first[3]], [block_hashes(tokens, 2)[3]])]
    kv.free("b")
    assert kv.reset_prefix_cache() and rec.calls[-1] == ("cleared",)
    assert all(not g._cached for g in kv.groups)
    kv.check_integrity()
