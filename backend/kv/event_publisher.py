"""The KV-cache event publisher: one thread off the engine's hot path that turns a step's records into
vLLM's KVEventBatch and sends it over ZMQ, as vLLM's ZmqEventPublisher does (backend/kv/events.py
says what the events are; docs/gateway.md how a router subscribes).

- PUB socket (`endpoint`): three frames per batch, the topic, the batch's sequence number (8 bytes,
  big-endian, from 0 without gaps) and the msgpack payload [timestamp, [events...], data-parallel
  rank]. An address with `*`, `::`, ipc:// or inproc:// is bound, any other connected to (vLLM's
  rule); a data-parallel rank r > 0 moves a tcp port up by r (another address gets `_dp<r>`).
- ROUTER socket (`replay_endpoint`, optional): a request [empty frame, 8-byte start sequence] (a
  DEALER's, as the llm-d indexer sends it) is answered with [empty, topic, seq, payload] for every
  buffered batch from that number on, then [empty, empty, -1 as 8 signed bytes, empty] (vLLM's
  current replay frames). The last `buffer_steps` batches are kept.
- The engine hands records over through a bounded queue and never waits on it: when it is full a
  step's batch is dropped, counted and logged, and the next batch that fits starts with
  AllBlocksCleared, so a subscriber forgets this engine's blocks rather than keep a stale view.

pyzmq and msgpack load when the publisher starts (events on), never otherwise.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from typing import Any, Callable, Optional

from backend.core.kv_events_config import KVEventsConfig
from backend.kv.events import KVEventCollector, VllmEventEncoder

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def rank_endpoint(endpoint: Optional[str], rank: int) -> Optional[str]:
    """The address of data-parallel rank `rank` (vLLM's offset_endpoint_port)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The publisher thread and its sockets; `collector` is the BlockListener to attach."""

    def __init__(self, config: KVEventsConfig, block_size: int, num_blocks: int, medium: str,
                 lora_name_of: Callable[[bytes], Optional[str]] = lambda root: None):
        self.config = config
        self.endpoint = rank_endpoint(config.endpoint, config.data_parallel_rank)
        self.replay_endpoint = rank_endpoint(config.replay_endpoint, config.data_parallel_rank)
        self.encoder = VllmEventEncoder(block_size, medium, capacity=num_blocks)
        self.collector = KVEventCollector(self._submit, lora_name_of)
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque = deque(maxlen=config.buffer_steps)  # (seq, payload)
        self._seq = itertools.count()
        self.num_dropped = 0
        self._lost = False  # a batch was dropped: the next one starts with AllBlocksCleared
        self._started = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="inflight-kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise ValueError(f"kv_events_config: cannot open the ZMQ sockets ({self.endpoint}"
                             f"{', replay ' + self.replay_endpoint if self.replay_endpoint else ''}): "
                             f"{self._error}") from self._error

    # -- the engine thread ----------------------------------------------------------------------
    def _submit(self, ts: float, records: list[tuple]) -> None:
        if self._lost:
            records = [("cleared",)] + records
        try:
            self._queue.put_nowait((ts, records))
            self._lost = False
        except queue.Full:
            self.num_dropped += 1
            self._lost = True
            log.warning("KV events: the publisher is %d batches behind; a batch was dropped (%d so far), "
                        "subscribers will be told to clear this engine's blocks", self._queue.qsize(), self.num_dropped)

    @property
    def listener(self) -> KVEventCollector:
        """The BlockListener the KV-cache groups are made with (their first group's)."""
        return self.collector

    def started(self, blocks) -> None:
        """The cache it listens to exists: the first batch is AllBlocksCleared (the cache is empty,
        and a subscriber that kept blocks of an earlier process on this topic, a restarted pod keeps
        its name, drops them)."""
        blocks.reset_prefix_cache()
        self.end_step()

    def end_step(self) -> None:
        """The engine's step ended: its records go out as one batch."""
        self.collector.end_step()

    def close(self, timeout: float = 2.0) -> None:
        """Publish what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put((None, None))
            self._thread.join(timeout)

    # -- the publisher thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            import msgpack
            import zmq

            context = zmq.Context()
            pub = context.socket(zmq.PUB)
            pub.set_hwm(self.config.hwm)
            (pub.bind if _binds(self.endpoint) else pub.connect)(self.endpoint)
            replay = None
            if self.replay_endpoint:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.replay_endpoint)
        except BaseException as exc:  # raised again in __init__, on the engine's thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        topic = self.config.topic.encode("utf-8")
        try:
            while True:
                while replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    ts, records = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if records is None:
                    break
                try:
                    events = self.encoder.events(records)
                    if not events:
                        continue
                    payload = msgpack.packb([ts, events, self.config.data_parallel_rank], use_bin_type=True)
                    seq = next(self._seq)
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                except Exception:  # one bad batch must not end publishing
                    log.exception("KV events: publishing a batch failed")
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            context.term()

    def _serve_replay(self, replay) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames was ignored (want: identity, empty, "
                        "8-byte start sequence)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        topic = self.config.topic.encode("utf-8")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


class NoPublisher:
    """kv_events_config off: the engine's calls cost a no-op, and the block manager has no listener."""
    listener = None

    def started(self, blocks) -> None:
        pass

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_publisher(config: Optional[KVEventsConfig], block_size: int, num_blocks: int, device: Any,
                   lora_name_of: Callable[[bytes], Optional[str]]) -> "KVEventPublisher | NoPublisher":
    """The publisher of a cache of `num_blocks` blocks (a NoPublisher when kv_events_config does not
    publish); its `listener` is given to the KV-cache groups as they are made, then `started`."""
    if config is None or not config.publishes:
        return NoPublisher()
    medium = "GPU" if getattr(device, "type", str(device)) == "cuda" else "CPU"
    return KVEventPublisher(config, block_size, num_blocks, medium, lora_name_of)
