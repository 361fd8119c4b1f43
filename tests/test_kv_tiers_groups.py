"""The KV tiers on a model of several KV-cache groups (backend/kv/tiers/grouped.py): the hit that
the device's caches and the tiers hold together (a local group's window before its end, nothing
before it), the tables it attaches; and on a tiny Gemma 3 (a global layer, two local ones of
window 13) conversations whose prefixes leave the KV cache come back from host memory and from
disk with transformers' greedy tokens, a file that fails its check sends its request back to its
device prefix, and nothing is left held."""
from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from backend.kv.block_pool import NULL_BLOCK, block_hashes
from backend.kv.groups import KVCacheGroups
from backend.kv.tiers.grouped import GroupListener, group_key, tiered_hit
from tier_chats import MAX_TOKENS, assert_idle, chat_turns, run_turns, written_turns

# 36 pool blocks (192 tokens x 3 layers, one slot): 6 conversations' prefixes never fit; always load
ENGINE = dict(kv_block_size=16, max_tokens_in_paged_kv_cache=192, max_num_seqs=2, max_num_batched_tokens=64,
              kv_tier_load_policy="always")


# -- the hit ------------------------------------------------------------------------------------

def groups_with_a_sequence(tokens, windows=(0, 5, 3)):
    """Block size 2; tokens computed by "a", registered and slid, then freed: every block cached."""
    kv = KVCacheGroups(64, 2, windows, enable_prefix_caching=True, max_prefill_tokens=64)
    kv.grow("a", len(tokens))
    kv.register_computed("a", tokens, len(tokens))
    kv.slide("a", len(tokens))
    tables = kv.block_tables("a")
    kv.free("a")
    return kv, tables


def test_a_group_key_is_the_prefix_key_for_the_first_group_and_its_own_for_the_others():
    key = bytes(range(32))
    assert group_key(key, 0) == key
    keys = {group_key(key, g) for g in range(1, 6)}
    assert len(keys) == 5 and key not in keys and all(len(k) == 32 for k in keys)


def test_the_hit_needs_the_first_group_to_its_end_and_each_window_before_it():
    tokens = list(range(1, 22))  # 10 full blocks of 2 (the last token is never reused)
    kv, tables = groups_with_a_sequence(tokens)
    hashes = block_hashes(tokens, 2, len(tokens) - 1)
    assert kv.reuse_prefix("b", hashes=hashes) == 20  # everything is still on the device
    kv.free("b")
    # the device's first group keeps blocks 0..3; the tiers hold the first group's 4..9, the
    # windows of group 1 (5 tokens: 2 blocks) and group 2 (3 tokens: 1 block) only before 6
    tiers = {group_key(h, 0): False for h in hashes[4:]}
    tiers.update({group_key(hashes[i], 1): True for i in (4, 5)})
    tiers.update({group_key(hashes[5], 2): False})
    for g, manager in enumerate(kv.groups):  # the device keeps the first group's blocks 0..3 alone
        for i in range(4 if g == 0 else 0, 10):
            manager._forget_hash(manager.cached_block(hashes[i]))
    assert kv.prefix_hit(hashes) == 0  # on the device alone no local group has a window
    hit = tiered_hit(kv, "c", hashes, 0, tiers.get)
    assert (hit.start, hit.end) == (0, 6)  # 6 is the last end where every window is held
    assert hit.entries[0] == [tables[0][i] for i in range(4)] + [None, None]  # shared, then loaded
    assert hit.entries[1] == [NULL_BLOCK] * 4 + [None, None]  # nothing before group 1's window
    assert hit.entries[2] == [NULL_BLOCK] * 5 + [None]
    assert hit.keys == [group_key(hashes[4], 0), group_key(hashes[4], 1), group_key(hashes[5], 0),
                        group_key(hashes[5], 1), group_key(hashes[5], 2)]
    assert hit.from_disk == [False, True, False, True, False]
    assert hit.first_group == [None] * 4 + [False, False]
    # a tier that holds no local window: no end past the device's
    assert tiered_hit(kv, "c", hashes, 0, {group_key(h, 0): False for h in hashes}.get) is None


def test_attaching_a_hit_shares_the_device_blocks_takes_the_rest_and_keeps_the_tables_whole():
    tokens = list(range(1, 22))
    kv, tables = groups_with_a_sequence(tokens)
    hashes = block_hashes(tokens, 2, len(tokens) - 1)
    for g, manager in enumerate(kv.groups):
        for i in range(6, 10):
            block = manager.cached_block(hashes[i])
            if block is not None:
                manager._forget_hash(block)
    where = {group_key(hashes[i], g): False for i in range(6, 10) for g in range(3)}.get
    kv.grow("other", 4)  # someone holds two blocks meanwhile
    hit = tiered_hit(kv, "c", hashes, 0, where)
    assert hit.end == 10
    used = kv.num_used_blocks
    taken = kv.attach("c", hit.entries)
    assert [len(t) for t in taken] == [4, 2, 1]  # the first group's 6..9; each window's
    first, local5, local3 = kv.block_tables("c")
    assert first[:6] == tables[0][:6] and first[6:] == taken[0]
    assert local5 == [NULL_BLOCK] * 8 + taken[1] and local3 == [NULL_BLOCK] * 9 + taken[2]
    assert kv.num_used_blocks == used + 6 + 7  # 6 cached blocks held again, 7 taken
    kv.check_integrity()
    kv.free("c")
    kv.free("other")
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_a_hit_past_a_device_prefix_gives_back_the_windows_it_leaves_behind():
    tokens = list(range(1, 22))
    kv, tables = groups_with_a_sequence(tokens)
    hashes = block_hashes(tokens, 2, len(tokens) - 1)
    keep = ({0, 1, 2, 3, 4, 5}, {2, 3}, {3})  # per group, the positions the device still caches
    for g, manager in enumerate(kv.groups):
        for i in range(10):
            if i not in keep[g]:
                manager._forget_hash(manager.cached_block(hashes[i]))
    assert kv.reuse_prefix("c", hashes=hashes) == 8  # the windows before block 4 are there
    where = {group_key(hashes[i], g): False for g, i in [(0, 6), (0, 7), (0, 8), (0, 9), (1, 8), (1, 9), (2, 9)]}
    hit = tiered_hit(kv, "c", hashes, 4, where.get)
    assert (hit.start, hit.end) == (4, 10)
    assert hit.entries[0] == [tables[0][4], tables[0][5], None, None, None, None]
    windows = {(g, i): kv.block_tables("c")[g][i] for g, i in [(1, 2), (1, 3), (2, 3)]}
    assert kv.num_blocks_of("c") == 4 + 2 + 1
    taken = kv.attach("c", hit.entries)
    first, local5, local3 = kv.block_tables("c")
    assert first == tables[0][:6] + taken[0]
    assert local5 == [NULL_BLOCK] * 8 + taken[1] and local3 == [NULL_BLOCK] * 9 + taken[2]
    for (g, i), block in windows.items():  # the device prefix's windows are given back, still cached
        assert kv.ref_count(block) == 0 and kv.groups[g].cached_block(hashes[i]) == block
    kv.check_integrity()
    kv.free("c")
    assert kv.num_used_blocks == 0


def test_a_group_listener_tells_the_tiers_its_own_keys():
    heard = []

    class Tiers:
        def blocks_stored(self, blocks, keys, parent, root, token_ids):
            heard.append(("stored", blocks, keys))

        def blocks_removed(self, blocks, keys):
            heard.append(("removed", blocks, keys))

    kv = KVCacheGroups(8, 2, (0, 3), enable_prefix_caching=True, max_prefill_tokens=8)
    kv.groups[1].listeners.append(GroupListener(Tiers(), 1))
    kv.grow("a", 5)
    kv.register_computed("a", [1, 2, 3, 4, 5], 5)
    h = block_hashes([1, 2, 3, 4, 5], 2)
    assert heard == [("stored", kv.block_tables("a")[1][:2], [group_key(h[0], 1), group_key(h[1], 1)])]


# -- the engine on a tiny Gemma 3 ---------------------------------------------------------------

@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """6 conversations x 3 turns on one system prompt (37 tokens), each turn 9-23 tokens more."""
    return chat_turns("gemma3", tmp_path_factory.mktemp("gemma3-tiers"), seed=6, rng_seed=12)


def block_bytes(llm):
    return llm.engine.kv_tiers.block_bytes


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_returning_turns_of_a_model_of_three_groups_come_back_from_host_memory(chat):
    path, turns, expected = chat
    llm = LLM(str(path), kv_host_cache_bytes=1 << 20, **ENGINE)
    assert llm.engine.runner.kv_layout.num_groups == 3
    k = llm.engine.runner.kv_caches[0][0]  # a slot holds a block of one group's layers (one here), K and V
    assert block_bytes(llm) == llm.engine.runner.kv_layout.slots * 2 * k[0].numel() * k.element_size()
    assert run_turns(llm, turns) == expected
    host = llm.stats()["kv_tiers"]["host"]
    assert host["hits"] > 0 and host["load_chosen"] > host["hits"], host  # the windows' blocks too
    assert host["bytes_loaded"] == host["load_chosen"] * block_bytes(llm), host
    assert_idle(llm)
    with_tiers = llm.engine.scheduler.prefix_hit_tokens
    llm.close()
    without = LLM(str(path), **{k: v for k, v in ENGINE.items() if k != "kv_tier_load_policy"})
    assert run_turns(without, turns) == expected
    assert with_tiers > without.engine.scheduler.prefix_hit_tokens  # computed again without them
    without.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_the_disk_tier_of_a_model_of_three_groups_survives_a_restart(chat, tmp_path):
    path, turns, expected = chat
    tiers = dict(kv_host_cache_bytes=1 << 18, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 22)
    # closed, the engine writes the device's cached blocks down, every group's
    assert written_turns(lambda: LLM(str(path), **tiers, **ENGINE), turns[:2]) == expected[:2]
    again = LLM(str(path), **tiers, **ENGINE)
    request = again.engine.add_request("first", turns[2][0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    while again.engine.has_work():
        again.engine.step()
    assert request.output_token_ids == expected[2][0]
    disk = again.stats()["kv_tiers"]["disk"]
    assert disk["hits"] > 0 and disk["load_chosen"] > disk["hits"] and disk["rejected"] == 0, disk
    # its earlier turn's prompt, whole blocks, came back (the turn's answer was never in its tokens)
    assert request.num_cached_tokens >= 16 * ((len(turns[1][0]) - 1) // 16 - 1)
    assert_idle(again)
    again.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_a_host_front_too_small_for_a_whole_hit_brings_back_a_shorter_one(chat, tmp_path):
    """A disk block is staged in a host slot: with 4 slots the returning prompt's hit (6 loads: its
    4 blocks of the first group and the local groups' windows) cannot be claimed whole, and a part
    would leave a window short; the longest shorter hit that fits comes back instead of nothing."""
    path, turns, expected = chat
    tiers = dict(kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 22)
    written_turns(lambda: LLM(str(path), kv_host_cache_bytes=1 << 20, **tiers, **ENGINE), turns[:2])
    cached = {}
    for slots in (16, 4):
        again = LLM(str(path), kv_host_cache_bytes=slots * 8192, **tiers, **ENGINE)
        assert block_bytes(again) == 8192 and again.stats()["kv_tiers"]["host"]["blocks_total"] == slots
        request = again.engine.add_request("first", turns[2][0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        while again.engine.has_work():
            again.engine.step()
        assert request.output_token_ids == expected[2][0]
        disk = again.stats()["kv_tiers"]["disk"]
        assert disk["load_chosen"] <= slots and disk["bytes_loaded"] == disk["load_chosen"] * 8192, disk
        cached[slots] = request.num_cached_tokens
        assert_idle(again)
        again.close()
    assert 0 < cached[4] < cached[16], cached


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_a_file_that_fails_its_check_sends_the_request_back_to_its_device_prefix(chat, tmp_path):
    path, turns, expected = chat
    tiers = dict(kv_host_cache_bytes=1 << 18, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 22)
    written_turns(lambda: LLM(str(path), **tiers, **ENGINE), turns[:2])
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    for f in sorted(folder.iterdir())[::2]:  # every other file tampered with: a payload byte
        data = bytearray(f.read_bytes())
        data[-40] ^= 0x01
        f.write_bytes(bytes(data))
    again = LLM(str(path), **tiers, **ENGINE)
    assert run_turns(again, [turns[2]]) == [expected[2]]  # computed again where a load failed, right
    disk = again.stats()["kv_tiers"]["disk"]
    assert disk["tampered"] >= 1, disk
    assert_idle(again)
    again.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_a_grouped_load_the_request_waits_for_brings_the_same_tokens(chat):
    """Where a load does not land before the step's model run (a GPU's copy stream), the request
    holds its blocks, runs no row until the load is done, and then counts the hit's positions."""
    path, turns, expected = chat
    llm = LLM(str(path), kv_host_cache_bytes=1 << 20, **ENGINE)
    llm.engine.kv_tiers.loads_at_once = False
    assert run_turns(llm, turns) == expected
    host = llm.stats()["kv_tiers"]["host"]
    assert host["hits"] > 0 and host["bytes_loaded"] > 0, host
    assert llm.engine.scheduler.prefix_hit_tokens > 0
    assert_idle(llm)
    llm.close()
