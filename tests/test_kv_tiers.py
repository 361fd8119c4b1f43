"""KV-cache tiers (backend/kv_tiers/) on the CPU engine: conversations whose prefixes do not fit in
the KV cache come back from host memory and from disk instead of being computed again, with
transformers' greedy tokens; the disk tier survives a restart and refuses torn or foreign files;
a request given up while its prefix is on its way back leaks nothing."""
import os
import threading
import time

import pytest

from backend import LLM, EngineConfig, SamplingParams
from backend.kv.tiers.disk import DiskStore
from backend.kv.tiers.index import HostIndex
from backend.kv.tiers.plan import CopyPrices
from tier_chats import MAX_TOKENS, assert_idle, chat_turns, run_turns

BLOCK_BYTES = 4096  # the llama checkpoint: 2 layers x K,V x 16 tokens x 2 kv heads x 8 dims x 4 bytes
FILE_BYTES = 80 + BLOCK_BYTES + 32  # a disk tier file: header, block, HMAC-SHA256 (backend/kv/tiers/disk.py)
# 10 blocks of 16: one request's prompt at most (7 blocks); 6 conversations' prefixes never fit.
# Every prefix found is loaded (kv_tier_load_policy always): these tests are about the tiers' copies,
# which auto would skip where this machine computes the tiny model's tokens faster (see the last tests).
ENGINE = dict(kv_block_size=16, max_tokens_in_paged_kv_cache=160, max_num_seqs=2, max_num_batched_tokens=64,
              kv_tier_load_policy="always")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """6 conversations x 3 turns on one system prompt (37 tokens): turn t's prompt is turn t-1's
    with 9-23 new tokens, so every returning turn starts with its conversation's earlier blocks."""
    return chat_turns("llama", tmp_path_factory.mktemp("llama-tiers"), seed=5, rng_seed=11)


def reusable_tokens(turns):
    """Tokens of the returning turns that earlier turns computed: each prompt's full blocks of the
    one before it (its new tokens are new; a block that held the earlier answer differs)."""
    return sum(16 * (len(turns[t - 1][c]) // 16) for t in range(1, len(turns)) for c in range(len(turns[t])))


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_returning_turns_come_back_from_host_memory_with_transformers_tokens(chat):
    path, turns, expected = chat
    llm = LLM(str(path), kv_host_cache_bytes=64 * BLOCK_BYTES, **ENGINE)
    assert run_turns(llm, turns[:1]) == expected[:1]
    first = llm.stats()["prefix_cache_hit_tokens"]
    assert run_turns(llm, turns[1:]) == expected[1:]
    # every block an earlier turn computed was found, in the device cache or in host memory
    assert llm.stats()["prefix_cache_hit_tokens"] - first == reusable_tokens(turns)
    host = llm.stats()["kv_tiers"]["host"]
    assert host["hits"] >= 12, host  # most came back from the host: the cache holds 10 blocks
    assert host["bytes_loaded"] == host["hits"] * BLOCK_BYTES and host["bytes_stored"] >= host["bytes_loaded"]
    assert 0 < host["blocks_used"] <= host["blocks_total"] == 64
    assert_idle(llm)
    llm.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_without_tiers_the_same_turns_recompute(chat):
    path, turns, expected = chat
    llm = LLM(str(path), **ENGINE)
    assert run_turns(llm, turns[:1]) == expected[:1]
    first = llm.stats()["prefix_cache_hit_tokens"]
    assert run_turns(llm, turns[1:]) == expected[1:]
    assert "kv_tiers" not in llm.stats()
    assert llm.stats()["prefix_cache_hit_tokens"] - first < reusable_tokens(turns) - 16 * 12
    llm.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_the_disk_tier_serves_what_the_host_gave_away_and_survives_a_restart(chat, tmp_path):
    path, turns, expected = chat
    tiers = dict(kv_host_cache_bytes=6 * BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 20)
    llm = LLM(str(path), **tiers, **ENGINE)
    assert run_turns(llm, turns) == expected
    disk = llm.stats()["kv_tiers"]["disk"]
    assert disk["hits"] > 0 and disk["bytes_loaded"] == disk["hits"] * BLOCK_BYTES and disk["rejected"] == 0, disk
    assert_idle(llm)
    llm.close()  # the device's cached blocks are written down too
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    files = sorted(folder.iterdir())
    assert files and all(f.suffix == ".kv" and f.stat().st_size == FILE_BYTES for f in files)

    again = LLM(str(path), **tiers, **ENGINE)  # a restart: nothing in the device cache or the host pool
    assert len(again.engine.kv_tiers.disk_index) == len(files)
    request = again.engine.add_request("first", turns[2][0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    while again.engine.has_work():
        again.engine.step()
    assert request.output_token_ids == expected[2][0]
    full_blocks = (len(turns[2][0]) - 1) // 16
    assert again.stats()["kv_tiers"]["disk"]["hits"] == full_blocks  # every full block of its prompt
    assert request.num_cached_tokens == 16 * full_blocks
    assert_idle(again)
    again.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_shutdown_writes_the_cached_blocks_to_an_empty_disk_tier(chat, tmp_path):
    path, turns, _ = chat
    llm = LLM(str(path), kv_host_cache_bytes=6 * BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path),
              kv_disk_cache_bytes=1 << 20, **ENGINE)
    llm.generate([turns[0][0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))  # 2 full blocks, no eviction
    assert not list(tmp_path.rglob("*.kv"))
    llm.close()
    assert len(list(tmp_path.rglob("*.kv"))) == len(turns[0][0]) // 16


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_torn_and_foreign_files_are_refused_and_computed_again(chat, tmp_path):
    path, turns, expected = chat
    tiers = dict(kv_host_cache_bytes=6 * BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 20)
    llm = LLM(str(path), **tiers, **ENGINE)
    run_turns(llm, turns[:1])
    llm.close()
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    files = sorted(folder.iterdir())
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i % 3 == 0:
            data = data[:len(data) // 2]  # torn: a crash cut the write short
        elif i % 3 == 1:
            data[8] ^= 0xFF  # foreign: another model's fingerprint
        else:
            data[-40] ^= 0x01  # tampered: a payload byte that does not match the HMAC
        f.write_bytes(bytes(data))

    again = LLM(str(path), **tiers, **ENGINE)
    assert run_turns(again, [turns[0][:2]]) == [expected[0][:2]]  # computed again, right
    stats = again.stats()
    # (both prompts start with the system prompt's block: the second read of it finds the file the first
    # refused already gone, a miss, not a second refusal)
    assert stats["kv_tiers"]["disk"]["rejected"] + stats["kv_tiers"]["disk"]["tampered"] >= 1, stats["kv_tiers"]
    assert stats["kv_tiers"]["host"]["bytes_loaded"] == 0  # nothing refused was ever copied into the cache
    torn = [f for f in files if f.exists() and f.stat().st_size != FILE_BYTES]
    assert not torn  # a short file is dropped when the folder is scanned, the rest when read
    assert_idle(again)
    again.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_a_request_given_up_while_its_prefix_is_read_from_disk_leaks_nothing(chat, tmp_path, monkeypatch):
    path, turns, expected = chat
    tiers = dict(kv_host_cache_bytes=6 * BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_bytes=1 << 20)
    llm = LLM(str(path), **tiers, **ENGINE)
    run_turns(llm, turns[:1])
    llm.close()
    gate = threading.Event()
    read = DiskStore._read
    monkeypatch.setattr(DiskStore, "_read", lambda self, key, dest: (gate.wait(10), read(self, key, dest))[1])
    again = LLM(str(path), **tiers, **ENGINE)
    engine = again.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    held = engine.add_request("held", turns[1][0], params)
    other = engine.add_request("other", [5, 6, 7], params)
    for _ in range(3):
        engine.step()
    assert held.kv_load is not None and not held.output_token_ids  # waits for its blocks, runs no row
    assert len(other.output_token_ids) >= 2  # a started request is never paused by someone's copy
    engine.abort("held")
    while engine.has_work():
        engine.step()
    gate.set()  # the reads land after the last step: polling alone must give the slots back
    deadline = time.monotonic() + 60  # (slow on a busy machine)
    while engine.kv_tiers.busy and time.monotonic() < deadline:
        engine.kv_tiers.poll()
        engine.kv_tiers.disk.wait(0.1)
    assert_idle(again)
    assert again.stats()["kv_tiers"]["host"]["bytes_loaded"] == 0  # nothing was copied into blocks it gave back
    assert again.generate([turns[1][0]], params)[0].token_ids == expected[1][0]  # and it still serves
    assert_idle(again)
    again.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_a_failed_copy_forgets_its_saves_and_brings_nothing(chat, monkeypatch):
    path, turns, expected = chat
    llm = LLM(str(path), kv_host_cache_bytes=64 * BLOCK_BYTES, **ENGINE)
    run_turns(llm, turns[:1])
    engine, failed = llm.engine, []
    real = engine.kv_tiers.copier.execute

    def broken(plan):
        if plan.loads:
            failed.append(plan)
            raise RuntimeError("copy failed")
        return real(plan)

    monkeypatch.setattr(engine.kv_tiers.copier, "execute", broken)
    engine.add_request("x", turns[1][0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    outputs = []
    while engine.has_work():  # the copies are the step's (the worker makes them): it fails its requests
        outputs += engine.step()
    assert [(o.finish_reason, "copy failed" in o.error) for o in outputs if o.finished] == [("error", True)]
    assert failed and not any(engine.kv_tiers.host.pins)
    assert_idle(llm)
    monkeypatch.setattr(engine.kv_tiers.copier, "execute", real)
    assert run_turns(llm, [turns[1]]) == [expected[1]]  # and it serves on
    assert_idle(llm)


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_preempted_requests_under_max_utilization_keep_transformers_tokens(chat):
    path, turns, expected = chat
    # unpaced: preemptions that do not follow step times (test_engine_vs_hf.py)
    llm = LLM(str(path), kv_host_cache_bytes=64 * BLOCK_BYTES, batch_scheduler_policy="max_utilization",
              **{**ENGINE, "max_tokens_in_paged_kv_cache": 112, "max_num_seqs": 4, "inter_token_target_ms": 0})
    assert run_turns(llm, turns) == expected
    # a preempted request's full blocks stay cached, go to the host when handed out, and come back
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["kv_tiers"]["host"]["hits"] > 0
    assert_idle(llm)
    llm.close()


@pytest.mark.parametrize("settings, words", [
    (dict(kv_host_cache_bytes=-1), ["kv_host_cache_bytes", ">= 0"]),
    (dict(kv_disk_cache_dir="/tmp/x"), ["kv_disk_cache_bytes > 0"]),
    (dict(kv_disk_cache_bytes=1 << 20), ["kv_disk_cache_dir"]),
    (dict(kv_disk_cache_dir="/tmp/x", kv_disk_cache_bytes=1 << 20), ["kv_host_cache_bytes > 0"]),
    (dict(kv_host_cache_bytes=1 << 20, enable_kv_cache_reuse=False), ["enable_kv_cache_reuse"]),
    (dict(kv_host_cache_bytes=1 << 20, batching_mode="static"), ["batching_mode"]),
    (dict(kv_host_cache_bytes=1 << 20, tensor_parallel_size=2), ["tensor_parallel_size"]),
])
def test_bad_tier_settings_are_refused_naming_the_key(settings, words):
    with pytest.raises(ValueError) as err:
        EngineConfig(**settings)
    assert all(w in str(err.value) for w in words), err.value
    assert EngineConfig().enable_kv_cache_reuse is True  # prefix reuse is on by default


def test_a_host_tier_smaller_than_a_block_is_refused(default_model_dir):
    with pytest.raises(ValueError, match="kv_host_cache_bytes .* smaller than one KV block"):
        LLM(str(default_model_dir), kv_host_cache_bytes=100, **ENGINE)


def test_host_slots_are_given_away_least_recently_used_first_and_never_while_pinned():
    index = HostIndex(3)
    for key in (b"a", b"b", b"c"):
        slot, gone = index.take()
        assert gone is None
        index.bind(key, slot)
        index.unpin(slot)
    index.touch(b"a")
    index.pin(index.slot(b"b"))  # a copy reads it
    slot, gone = index.take()
    assert gone == b"c" and slot not in (index.slot(b"a"), index.slot(b"b"))  # b is older but pinned
    index.check_integrity()
    index.unpin(slot)  # taken, never bound: it goes back to the free list
    index.check_integrity()
    assert index.num_used == 2 and len(index) == 2


def test_disk_files_are_checked_before_anything_is_loaded(tmp_path):
    import numpy as np

    store = DiskStore(str(tmp_path), b"F" * 32, 64)
    block = np.arange(64, dtype=np.uint8)
    store.write(1, b"k" * 32, block)
    store.drain(5)
    out = np.zeros(64, dtype=np.uint8)
    store.read(2, b"k" * 32, out)
    store.drain(5)
    assert store.completed() == [(1, True, ""), (2, True, "")] and (out == block).all()
    other = DiskStore(str(tmp_path), b"G" * 32, 64)  # another model: another folder
    assert other.folder != store.folder and other.scan() == []
    os.replace(store.path(b"k" * 32), other.path(b"k" * 32))  # a file of the first model under its name
    other.read(3, b"k" * 32, out)
    other.drain(5)
    assert other.completed() == [(3, False, "foreign: another model, layout or format")]
    assert not other.path(b"k" * 32).exists()
    store.close()
    other.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_forced_recompute_gives_the_loaded_tokens_and_leaves_the_tiers_idle(chat):
    """kv_tier_load_policy never: the host tier keeps and finds the returning turns' blocks, but
    none is loaded; they are computed again, with the tokens of loading them (transformers')."""
    path, turns, expected = chat
    outs, host = {}, {}
    for policy in ("always", "never"):
        llm = LLM(str(path), kv_host_cache_bytes=64 * BLOCK_BYTES, **{**ENGINE, "kv_tier_load_policy": policy})
        outs[policy] = run_turns(llm, turns)
        host[policy] = llm.stats()["kv_tiers"]["host"]
        assert_idle(llm)
        llm.close()
    assert outs["never"] == outs["always"] == expected
    assert host["always"]["load_chosen"] == host["always"]["hits"] >= 12 and host["always"]["recompute_chosen"] == 0
    never = host["never"]
    assert never["recompute_chosen"] == never["hits"] >= 12 and never["load_chosen"] == never["bytes_loaded"] == 0


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_every_block_found_on_disk_is_counted_loaded_or_computed_again(chat, tmp_path):
    """Behind a host tier of 3 slots, some disk blocks found cannot be staged (no slot left): they
    are misses, so that per tier hits = load_chosen + recompute_chosen."""
    path, turns, expected = chat
    llm = LLM(str(path), kv_host_cache_bytes=3 * BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path / "kv"),
              kv_disk_cache_bytes=64 * FILE_BYTES, **ENGINE)
    assert run_turns(llm, turns) == expected
    tiers = llm.stats()["kv_tiers"]
    assert tiers["disk"]["hits"] >= 2, tiers  # (how many reach the disk in time varies)
    for tier in ("host", "disk"):
        assert tiers[tier]["hits"] == tiers[tier]["load_chosen"] + tiers[tier]["recompute_chosen"], tiers
    assert_idle(llm)
    llm.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_auto_loads_where_the_copy_is_cheaper_and_computes_where_it_is_dearer(chat):
    """The default policy weighs the copy's price (measured at start) against the engine's own price
    of the tokens: a copy made free loads every block found, one of 10 s a block loads none."""
    path, turns, expected = chat
    for prices, chosen in ((CopyPrices(0.0, 1e-12, 0.0), "load_chosen"), (CopyPrices(0.0, 10.0, 0.0), "recompute_chosen")):
        llm = LLM(str(path), kv_host_cache_bytes=64 * BLOCK_BYTES, **{**ENGINE, "kv_tier_load_policy": "auto"})
        measured = llm.engine.kv_tiers.prices
        assert 0 < measured.plan_seconds + measured.host_block_seconds < 0.1, measured  # (4 KB blocks: ~all plan)
        llm.engine.scheduler.admission.tiers.choice.prices = prices
        assert run_turns(llm, turns) == expected
        host = llm.stats()["kv_tiers"]["host"]
        assert host[chosen] == host["hits"] >= 12, host
        assert_idle(llm)
        llm.close()


@pytest.mark.slow  # the transformers oracle's checkpoint and greedy runs (module fixture)
def test_auto_computes_a_disk_block_again_rather_than_sit_out_a_busy_step(chat, tmp_path):
    """A disk block's request waits a step for its read: with the running requests' step priced at
    100 s (and copies free), auto computes every disk block found beside a running batch again."""
    path, turns, expected = chat
    llm = LLM(str(path), kv_host_cache_bytes=3 * BLOCK_BYTES, kv_disk_cache_dir=str(tmp_path / "kv"),
              kv_disk_cache_bytes=64 * FILE_BYTES, **{**ENGINE, "kv_tier_load_policy": "auto"})
    choice = llm.engine.scheduler.admission.tiers.choice
    choice.prices = CopyPrices(0.0, 0.0, 0.0)
    decode = choice.cost.decode_seconds
    choice.cost.decode_seconds = lambda rows, kv=None: 100.0 if rows else decode(rows, kv)
    assert run_turns(llm, turns) == expected
    disk = llm.stats()["kv_tiers"]["disk"]
    assert disk["recompute_chosen"] >= 1 and disk["recompute_chosen"] + disk["load_chosen"] == disk["hits"], disk
    assert_idle(llm)
    llm.close()


def test_the_host_pool_is_resident_when_the_engine_starts():
    """The host tier's memory is touched at allocation, not page by page by the first saves of a
    serving engine (a first touch costs up to tens of microseconds a page in a VM): mincore(2) finds
    every page of the pool resident."""
    import ctypes
    import mmap

    from backend.worker.device import host_empty

    pool = host_empty(64 << 20, pinned=False)
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = pool.data_ptr() // page * page
    length = pool.data_ptr() + pool.numel() - start
    vec = (ctypes.c_ubyte * -(-length // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    assert all(v & 1 for v in vec)
    assert not pool.any()
