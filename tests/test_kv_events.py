"""KV-cache events (kv_events_config, backend/kv/events.py): the engine publishes vLLM's
BlockStored / BlockRemoved / AllBlocksCleared batches, msgpack over ZMQ, and a subscriber of our own
(pyzmq + msgpack, as the llm-d indexer reads them) checks them against the truth:

- what the events say is cached equals what the block manager caches, block for block, after prompts
  that share a prefix and one that evicts;
- every block hash equals vLLM's sha256_cbor chain computed here with cbor2 (the library vLLM calls)
  on the same token ids, from NONE_HASH = sha256_cbor("vllm-none-hash"), 64-bit as vLLM sends them;
- sequence numbers run from 0 with no gap, and a subscriber that joins late gets what it missed from
  the replay socket, byte for byte what the others got live.
Engine-level (no server): the tiny default model with one layer, block size 8, a 12-block cache."""
from __future__ import annotations

import hashlib
import queue
import random
import subprocess
import sys

import cbor2
import msgpack
import pytest
import zmq

from backend.kv.block_manager import BlockListener, BlockManager, block_hashes
from backend.core.config import EngineConfig
from backend.core.kv_events_config import parse_kv_events_config
from backend.kv.events import cbor
from serving.triton_launcher import free_ports

BS = 8
TOPIC = "kv@10.0.0.7:9000@tiny"
END = (-1).to_bytes(8, "big", signed=True)


def vllm_chain(tokens: list[int], seed: str = "vllm-none-hash") -> list[tuple[int, list[int], int | None]]:
    """The oracle: (64-bit hash, block tokens, parent's 64-bit hash) of each full block, by vLLM's
    hash_block_tokens(sha256_cbor, parent, tokens, None) and maybe_convert_block_hash."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out, parent_int = [], None
    for start in range(0, len(tokens) - len(tokens) % BS, BS):
        block = tokens[start:start + BS]
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(block), None), canonical=True)).digest()
        value = int.from_bytes(parent, byteorder="big") & ((1 << 64) - 1)
        out.append((value, block, parent_int))
        parent_int = value
    return out


class Subscriber:
    def __init__(self, context, port: int):
        self.sock = context.socket(zmq.SUB)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.got: dict[int, bytes] = {}

    def drain(self, until: int, timeout_ms: int = 10000) -> None:
        """Receive until sequence number `until` has arrived."""
        while until not in self.got:
            assert self.sock.poll(timeout_ms), f"sequence {until} never arrived (got {sorted(self.got)[-3:]})"
            topic, seq, payload = self.sock.recv_multipart()
            assert topic.decode() == TOPIC
            self.got[int.from_bytes(seq, "big")] = payload


def replay(context, port: int, start: int) -> list[tuple[int, bytes]]:
    """The llm-d indexer's replay request: a DEALER sends [empty, start]; frames come back as
    [empty, topic, seq, payload] until the [empty, empty, -1, empty] end marker."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    try:
        while True:
            assert dealer.poll(10000), "no replay answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END:
                assert topic == b"" and payload == b""
                return out
            assert topic.decode() == TOPIC
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory, monkeypatch_module):
    """Prompt A; prompt B sharing A's first two blocks; a late subscriber joins; prompt C, which
    evicts. Returns everything the tests look at."""
    from backend import LLM, SamplingParams
    from backend.models.make_model import make_model

    monkeypatch_module.delenv("PYTHONHASHSEED", raising=False)  # vLLM's fixed seed, then
    path = make_model(tmp_path_factory.mktemp("kv-events"), num_hidden_layers=1)
    pub_port, replay_port = free_ports(2)
    llm = LLM(str(path), enable_kv_cache_reuse=True, kv_block_size=BS, max_tokens_in_paged_kv_cache=12 * BS,
              max_num_batched_tokens=64, kv_events_config={
                  "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
                  "replay_endpoint": f"tcp://*:{replay_port}", "topic": TOPIC})
    publisher = llm.engine.kv_events
    batches = [[("cleared",)]]  # what the engine handed over, one per step that changed the cache (the
    # first, the clear at start, before this wrapper)
    submit = publisher.collector.submit
    publisher.collector.submit = lambda ts, records: (batches.append(records), submit(ts, records))
    context = zmq.Context()
    rng = random.Random(1)
    sequences = []  # every sequence's tokens (prompt + output): the truth the oracle hashes

    def generate(prompt, max_tokens):
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
        sequences.append(prompt + out.token_ids)

    def join(sub):
        """Probe prompts (one full block each) until `sub` hears one: ZMQ drops what a SUB gets
        before its subscription reaches the publisher."""
        for _ in range(50):
            generate([rng.randrange(3, 512) for _ in range(BS + 1)], 1)
            if sub.sock.poll(200):
                return
        raise AssertionError("the subscriber never heard the publisher")

    try:
        early = Subscriber(context, pub_port)
        join(early)
        a = [rng.randrange(3, 512) for _ in range(45)]
        generate(a, 7)
        generate(a[:20] + [rng.randrange(3, 512) for _ in range(30)], 5)
        before_late = len(batches)
        early.drain(until=before_late - 1)  # all of them out before the late one connects: the publisher's
        # thread sends a batch when it gets the GIL, and one sent after the late SUB joined reaches it too
        late = Subscriber(context, pub_port)
        join(late)
        generate([rng.randrange(3, 512) for _ in range(70)], 4)  # 10 blocks of 12: evicts cached ones
        last = len(batches) - 1
        early.drain(until=last)
        late.drain(until=last)
        result = dict(llm=llm, early=early.got, late=late.got, before_late=before_late, last=last,
                      replayed=replay(context, replay_port, 0), replayed_late=replay(context, replay_port, before_late),
                      sequences=sequences, prompt_a=a)
        yield result
    finally:  # also when the set-up fails: no thread or socket outlives the module
        llm.engine.close()
        context.destroy(linger=0)  # term() would wait for the sockets left open


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def decoded(run) -> list[tuple[int, list]]:
    return [(seq, msgpack.unpackb(payload)) for seq, payload in run["replayed"]]


def test_sequence_numbers_have_no_gap_and_replay_returns_what_a_late_subscriber_missed(run):
    last, before_late = run["last"], run["before_late"]
    assert [seq for seq, _ in run["replayed"]] == list(range(last + 1))      # from 0, no gap, all buffered
    replayed = dict(run["replayed"])
    for got in (run["early"], run["late"]):                                  # contiguous from joining to the end
        assert sorted(got) == list(range(min(got), last + 1))
        assert all(replayed[seq] == payload for seq, payload in got.items())  # replay = what went out live
    assert min(run["late"]) >= before_late                                   # it missed everything before
    assert [seq for seq, _ in run["replayed_late"]] == list(range(before_late, last + 1))
    combined = {**dict(run["replayed_late"]), **run["late"]}                 # its view, completed by replay
    assert sorted(combined) == list(range(before_late, last + 1))


def test_batches_have_vllms_layout(run):
    for seq, (ts, events, rank) in decoded(run):
        assert isinstance(ts, float) and rank == 0 and events
        for event in events:
            assert event[0] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
            if event[0] == "BlockStored":
                hashes, parent, tokens, block_size, lora_id, medium, lora_name = event[1:]
                assert block_size == BS and len(tokens) == BS * len(hashes) and lora_id is None
                assert medium == "CPU" and lora_name is None
            elif event[0] == "BlockRemoved":
                assert len(event) == 3 and event[2] == "CPU"
    assert decoded(run)[0][1][1] == [["AllBlocksCleared"]]   # the engine starts by clearing its topic


def test_events_match_what_the_engine_stored_and_evicted(run):
    """Replaying the events gives exactly the blocks the block manager holds in its prefix cache,
    each with the right tokens and parent, and prompt B's first new block hangs off A's second."""
    oracle = {}  # 64-bit hash -> (block tokens, parent hash), for every full block of every sequence
    ours = {}    # our cache key -> 64-bit hash: the same blocks as the block manager keys them
    for tokens in run["sequences"]:
        chain = vllm_chain(tokens)
        for key, (value, block, parent) in zip(block_hashes(tokens, BS), chain):
            oracle[value] = (block, parent)
            ours[key] = value
    cached, stored, removed = set(), 0, 0
    for _, (_, events, _) in decoded(run):
        for event in events:
            if event[0] == "BlockStored":
                hashes, parent, tokens = event[1], event[2], event[3]
                stored += len(hashes)
                for i, value in enumerate(hashes):
                    assert value in oracle, "a hash the oracle does not know for these tokens"
                    assert oracle[value] == (tokens[i * BS:(i + 1) * BS], parent if i == 0 else hashes[i - 1])
                    cached.add(value)
            elif event[0] == "BlockRemoved":
                removed += len(event[1])
                assert set(event[1]) <= cached
                cached -= set(event[1])
            else:
                cached.clear()
    blocks: BlockManager = run["llm"].engine.blocks.groups[0]   # the events describe the first KV-cache group
    assert cached == {ours[key] for key in blocks._cached}    # the events' view is the engine's cache
    assert removed >= 1 and stored >= len(blocks._cached)
    a_chain = vllm_chain(run["prompt_a"])
    b_first = next(e for _, (_, events, _) in decoded(run) for e in events
                   if e[0] == "BlockStored" and e[2] == a_chain[1][0])
    assert b_first[3][:4] == run["prompt_a"][16:20]            # B's third block starts with A's shared tokens
    assert run["llm"].stats()["kv_blocks_used"] == 0
    run["llm"].check_integrity()


def test_the_hashes_follow_pythonhashseed_when_it_is_set(monkeypatch):
    from backend.kv.events import VllmEventEncoder

    tokens = list(range(3, 3 + 2 * BS + 3))
    keys = block_hashes(tokens, BS)
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    event = VllmEventEncoder(BS, "GPU", capacity=4).events([("stored", keys, b"", b"", tokens[:2 * BS], None)])[0]
    assert event[1] == [value for value, _, _ in vllm_chain(tokens, seed="1234")]
    assert event[1] != [value for value, _, _ in vllm_chain(tokens)]


def test_a_lora_adapters_blocks_name_it_and_hash_it_as_an_extra_key():
    from backend.kv.events import VllmEventEncoder, sha256_cbor

    tokens = list(range(10, 10 + BS))
    event = VllmEventEncoder(BS, "GPU", capacity=4, seed="s").events(
        [("stored", [b"k"], b"salt", b"salt", tokens, "sql")])[0]
    expected = hashlib.sha256(cbor2.dumps((sha256_cbor("s"), tuple(tokens), ("sql",)), canonical=True)).digest()
    assert event[1] == [int.from_bytes(expected[-8:], "big")] and event[2] is None and event[7] == "sql"


@pytest.mark.parametrize("value", [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -25,
                                   b"", b"x" * 300, "", "é" * 40, None, True, [], list(range(300)),
                                   (b"\x00" * 32, tuple(range(16)), None), (b"p", (1, 2), ("adapter",))])
def test_cbor_is_cbor2s_canonical_encoding(value):
    assert cbor(value) == cbor2.dumps(value, canonical=True)


class Recorder(BlockListener):
    def __init__(self):
        self.calls = []

    def blocks_stored(self, blocks, keys, parent, root, token_ids):
        self.calls.append(("stored", list(blocks), list(keys), parent, root, list(token_ids)))

    def blocks_removed(self, blocks, keys):
        self.calls.append(("removed", list(blocks), list(keys)))

    def cache_cleared(self):
        self.calls.append(("cleared",))


def test_the_block_listener_hears_runs_evictions_and_clears():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    rec = Recorder()
    bm.listeners.append(rec)
    a = [5, 6, 7, 8, 9]
    bm.grow("a", 5)
    bm.register_computed("a", a, 5)
    keys = block_hashes(a, 2)
    assert rec.calls == [("stored", bm.block_table("a")[:2], keys, b"", b"", a[:4])]
    # b computes the same first block itself (not attached): its copy is not registered, so its
    # next block is a run of its own, whose parent is the key a's block holds
    b = [5, 6, 1, 2, 3, 4]
    bm.grow("b", 6)
    bm.register_computed("b", b, 6)
    kb = block_hashes(b, 2)
    assert kb[0] == keys[0]
    assert rec.calls[-1] == ("stored", bm.block_table("b")[1:3], kb[1:], kb[0], b"", b[2:6])
    assert not bm.reset_prefix_cache()  # blocks are held
    bm.free("a")
    bm.free("b")
    rec.calls.clear()
    bm.grow("c", 12)                    # every block, so every cached one is evicted
    assert rec.calls[0][0] == "removed" and sorted(rec.calls[0][2]) == sorted(keys + kb[1:])
    bm.free("c")
    assert bm.reset_prefix_cache() and rec.calls[-1] == ("cleared",)
    bm.check_integrity()


def test_a_full_queue_drops_the_batch_and_the_next_one_clears_first(tmp_path):
    from backend.kv.event_publisher import KVEventPublisher

    config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "ipc://%s/pub"}' % tmp_path)
    publisher = KVEventPublisher(config, BS, 4, "CPU")
    try:
        real, publisher._queue = publisher._queue, queue.Queue(maxsize=1)
        publisher._queue.put(("blocker", []))
        publisher._submit(1.0, [("removed", [b"k"])])
        assert publisher.num_dropped == 1
        publisher._queue.get()
        publisher._submit(2.0, [("removed", [b"j"])])
        assert publisher._queue.get()[1] == [("cleared",), ("removed", [b"j"])]
    finally:
        publisher._queue = real
        publisher.close()


@pytest.mark.parametrize("raw, words", [
    ("{", ["kv_events_config", "JSON"]),
    ('{"enable_kv_cache_events": true, "port": 5557}', ["unknown key", "port", "endpoint"]),
    ('{"enable_kv_cache_events": "yes"}', ["enable_kv_cache_events", "type"]),
    ('{"publisher": "kafka"}', ["publisher", "zmq", "null"]),
    ('{"endpoint": "localhost:5557"}', ["endpoint", "tcp://"]),
    ('{"buffer_steps": 0}', ["buffer_steps", ">= 1"]),
    ("[1]", ["JSON object"]),
])
def test_bad_kv_events_configs_are_refused_naming_the_key(raw, words):
    with pytest.raises(ValueError) as err:
        EngineConfig(kv_events_config=raw, enable_kv_cache_reuse=True)
    assert all(w in str(err.value) for w in words), err.value


def test_events_need_the_prefix_cache_and_default_as_vllm():
    with pytest.raises(ValueError, match="enable_kv_cache_reuse"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True}, enable_kv_cache_reuse=False)
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.topic) == ("zmq", "tcp://*:5557", None, "")
    assert parse_kv_events_config('{"enable_kv_cache_events": false}').publishes is False
    assert parse_kv_events_config("") is None and EngineConfig().kv_events is None


def test_events_off_load_neither_zmq_nor_msgpack():
    code = ("import sys, backend.kv.events, backend.kv.event_publisher, backend.core.config\n"
            "print(sorted(m for m in ('zmq', 'msgpack', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_each_model_instance_publishes_on_its_own_ports(tmp_path):
    """Instance i of a config with several (Triton's llm_0_<i>) is data-parallel rank i: its tcp
    ports move up by i, as vLLM's ranks' do, and its batches carry i."""
    from adapter_module import load_adapter
    from backend.kv.event_publisher import rank_endpoint

    raw = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5559"}'
    params = {"model_path": str(tmp_path), "enable_kv_cache_reuse": "true", "kv_events_config": raw}
    first, second = (load_adapter().engine_config(params, "CPU", "0", tmp_path, f"llm_0_{i}").kv_events for i in (0, 1))
    assert (first.data_parallel_rank, second.data_parallel_rank) == (0, 1)
    assert [rank_endpoint(e, 1) for e in (second.endpoint, second.replay_endpoint)] == ["tcp://*:5558", "tcp://*:5560"]
    assert rank_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2" and rank_endpoint("tcp://h:1", 0) == "tcp://h:1"


def test_the_engines_stats_carry_the_publishers_figures(run):
    """inflight_kv_events_* (templates/metrics.py) read these stats() keys."""
    stats = run["llm"].stats()
    assert {k: stats[k] for k in ("kv_events_dropped", "kv_events_publisher_failures", "kv_events_bad_requests")} == \
        {"kv_events_dropped": 0, "kv_events_publisher_failures": 0, "kv_events_bad_requests": 0}
