"""The KV-cache event publisher: one thread off the engine's hot path that turns a step's records into
vLLM's KVEventBatch and sends it over ZMQ, as vLLM's ZmqEventPublisher does (backend/kv/events.py
says what the events are; docs/gateway.md how a router subscribes).

- PUB socket (`endpoint`): three frames per batch, the topic, the batch's sequence number (8 bytes,
  big-endian, from 0 without gaps) and the msgpack payload [timestamp, [events...], data-parallel
  rank]. An address with `*`, `::`, ipc:// or inproc:// is bound (a `*` on `bind_host`, the
  server's --host), any other connected to (vLLM's rule); a data-parallel rank r > 0 moves a tcp
  port up by r (another address gets `_dp<r>`).
- ROUTER socket (`replay_endpoint`, optional): a request [empty frame, 8-byte start sequence] (a
  DEALER's, as the llm-d indexer sends it) is answered with every buffered batch from that number
  on (backend/kv/event_sockets.py: the frames, and the size limits on both sockets). The last
  `buffer_steps` batches are kept.
- The engine hands records over through a bounded queue and never waits on it: when it is full a
  step's batch is dropped, counted and logged, and the next batch that fits starts with
  AllBlocksCleared, so a subscriber forgets this engine's blocks rather than keep a stale view.
- Publishing comes first: each round sends every queued batch, then at most
  `REPLAY_FRAMES_PER_ROUND` frames of replay answers, so a flood of requests delays events by a
  few frames' work at most (it held them 10 s before, issue 46). And replay answers get at most
  `REPLAY_SHARE` of the thread's time, after a burst of `REPLAY_BURST_S` of work (a whole buffer's
  answer, ~50 ms, goes out at full speed): a flood of requests, answered as fast as they came, kept
  this thread busy and the engine's thread waiting for the GIL (SmolLM2's decode at 0.53-0.62x).
- A publisher that stops (an error its loop cannot survive) says so: one ERROR line, the failure
  counted (`figures()`, inflight_kv_events_publisher_failures_total), and every later batch counted
  as dropped rather than queued for a thread that is gone.

pyzmq and msgpack load when the publisher starts (events on), never otherwise.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from backend.core.kv_events_config import KVEventsConfig
from backend.core.log_limit import LimitedLog
from backend.kv.event_sockets import LOG_INTERVAL_S, ReplayServer, open_sockets, rank_endpoint
from backend.kv.events import KVEventCollector, VllmEventEncoder

log = logging.getLogger(__name__)
REPLAY_FRAMES_PER_ROUND = 32  # replay frames sent between two looks at the queue of batches
PUBLISH_PER_ROUND = 256  # batches sent before the replay socket gets its turn
IDLE_WAIT_S = 0.02  # the longest a replay request waits while no batch comes
REPLAY_SHARE = 0.1  # of this thread's time, at most, for replay answers once their burst is spent
REPLAY_BURST_S = 0.2  # seconds of replay work allowed at full speed (a 2,000-batch answer: ~0.05 s)


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
        self.num_failures = 0  # the publisher thread stopped on an error (at most 1)
        self._replay: Optional[ReplayServer] = None
        self._drop_log = LimitedLog(log, LOG_INTERVAL_S)
        self._publish_log = LimitedLog(log, LOG_INTERVAL_S)
        self._lost = False  # a batch was dropped: the next one starts with AllBlocksCleared
        self._started = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="inflight-kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise ValueError(f"kv_events_config: cannot open the ZMQ sockets ({self.endpoint}"
                             f"{', replay ' + self.replay_endpoint if self.replay_endpoint else ''}"
                             f"{', bind_host ' + config.bind_host if config.bind_host else ''}): "
                             f"{self._error}") from self._error

    # -- the engine thread ----------------------------------------------------------------------
    def _submit(self, ts: float, records: list[tuple]) -> None:
        if self.num_failures:  # nobody would read the queue: count, never hold the records
            self.num_dropped += 1
            return
        if self._lost:
            records = [("cleared",)] + records
        try:
            self._queue.put_nowait((ts, records))
            self._lost = False
        except queue.Full:
            self.num_dropped += 1
            self._lost = True
            self._drop_log.warning("KV events: the publisher is %d batches behind; a batch was dropped (%d so far), "
                                   "subscribers will be told to clear this engine's blocks", self._queue.qsize(),
                                   self.num_dropped)

    def figures(self) -> dict[str, int]:
        """The engine's stats() keys of the events' metrics (templates/metrics.py)."""
        return {"kv_events_dropped": self.num_dropped, "kv_events_publisher_failures": self.num_failures,
                "kv_events_bad_requests": self._replay.num_bad if self._replay is not None else 0}

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

            topic = self.config.topic.encode("utf-8")  # checked by the config: UTF-8 carries it
            context, pub, replay = open_sockets(self.config, self.endpoint, self.replay_endpoint)
        except BaseException as exc:  # raised again in __init__, on the engine's thread
            self._error = exc
            self._started.set()
            return
        self._replay = ReplayServer(replay, topic) if replay is not None else None
        self._started.set()
        try:
            self._serve(pub, topic, msgpack)
        except BaseException as exc:  # surfaced: a line, a metric, and no more queueing
            self.num_failures += 1
            log.error("KV events: the publisher stopped (%s: %s); no more events go out until the engine restarts, "
                      "and subscribers keep their last view of this engine's blocks", type(exc).__name__, exc,
                      exc_info=True)
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            context.term()

    def _serve(self, pub, topic: bytes, msgpack) -> None:
        """Rounds of: every queued batch (up to PUBLISH_PER_ROUND), then a few frames of replay answers."""
        replay = self._replay
        budget = ReplayBudget(time.monotonic())
        while True:
            budget.refill(time.monotonic())
            wait = IDLE_WAIT_S
            if replay is not None and replay.busy():
                wait = min(IDLE_WAIT_S, budget.wait_s())
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            sent = 0
            while item is not None:
                ts, records = item
                if records is None:
                    return
                self._publish(pub, topic, msgpack, ts, records)
                sent += 1
                try:
                    item = self._queue.get_nowait() if sent < PUBLISH_PER_ROUND else None
                except queue.Empty:
                    item = None
            if replay is not None and budget.credit > 0:
                started = time.monotonic()
                replay.serve(self._buffer, REPLAY_FRAMES_PER_ROUND)
                budget.credit -= time.monotonic() - started

    def _publish(self, pub, topic: bytes, msgpack, ts: float, records: list[tuple]) -> None:
        try:
            events = self.encoder.events(records)
            if not events:
                return
            payload = msgpack.packb([ts, events, self.config.data_parallel_rank], use_bin_type=True)
            seq = next(self._seq)
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        except Exception:  # one bad batch must not end publishing
            self._publish_log.error("KV events: publishing a batch failed", exc_info=True)


class ReplayBudget:
    """The seconds of replay work allowed now (`credit`, spent by the caller): it refills at `share`
    of the time that passes and holds at most `burst`, so replay gets a burst at full speed and then
    `share` of the thread."""

    RESUME_S = 1e-4  # the credit a wait ends with: a wait to exactly 0 would end in a round of none

    def __init__(self, now: float, share: float = REPLAY_SHARE, burst: float = REPLAY_BURST_S):
        self.share, self.burst = share, burst
        self.credit, self._last = burst, now

    def refill(self, now: float) -> None:
        self.credit = min(self.burst, self.credit + (now - self._last) * self.share)
        self._last = now

    def wait_s(self) -> float:
        """How long until there is credit again, RESUME_S of it (0: there is some now)."""
        return 0.0 if self.credit > 0 else (self.RESUME_S - self.credit) / self.share


class NoPublisher:
    """kv_events_config off: the engine's calls cost a no-op, and the block manager has no listener."""
    listener = None

    def started(self, blocks) -> None:
        pass

    def end_step(self) -> None:
        pass

    def figures(self) -> dict[str, int]:
        return {}

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
