"""Batching gates: when waiting requests may join the running batch (`batching_mode`).

They exist to compare, on one engine and one workload, what each way of batching buys:
  inflight  iteration level: requests join at any step (the default);
  none      one request at a time;
  static    a batch of N starts once N wait or the oldest waited max_queue_delay; nothing joins
            until every member has finished;
  dynamic   request-level batches of up to max_num_seqs that wait at most max_queue_delay, formed
            from one length bucket (prompt lengths within dynamic_padding_threshold of each other),
            run to completion before the next batch starts.
No torch here.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from backend.config import EngineConfig
from backend.request import Request

UNLIMITED = 1 << 30


class BatchingGate:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.delay_s = config.max_queue_delay_microseconds / 1e6

    def num_to_admit(self, waiting: Sequence[Request], running: Sequence[Request], now: float) -> int:
        return UNLIMITED

    def next_candidate(self, waiting: Sequence[Request]) -> Request:
        return waiting[0]

    def next_deadline(self, waiting: Sequence[Request]) -> Optional[float]:
        """When a held batch will be released even if nothing else arrives."""
        return None

    def after_step(self, running: Sequence[Request]) -> None:
        pass


class InflightGate(BatchingGate):
    pass


class NoBatchingGate(BatchingGate):
    def num_to_admit(self, waiting, running, now) -> int:
        return 0 if running else 1


class StaticGate(BatchingGate):
    """A fixed batch: fill to N or time out, then run it out before the next one starts."""

    def batch_size(self) -> int:
        return self.config.static_batch_size

    def num_to_admit(self, waiting, running, now) -> int:
        if running or not waiting:
            return 0
        if len(waiting) >= self.batch_size() or now - waiting[0].arrival_time >= self.delay_s:
            return self.batch_size()
        return 0

    def next_deadline(self, waiting) -> Optional[float]:
        return waiting[0].arrival_time + self.delay_s if waiting else None


class DynamicGate(StaticGate):
    """Request-level batches from one length bucket, sorted so that padding stays small."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self._batch: list[Request] = []

    def batch_size(self) -> int:
        return self.config.max_num_seqs

    def num_to_admit(self, waiting, running, now) -> int:
        n = super().num_to_admit(waiting, running, now)
        if n == 0:
            return 0
        self._batch = self._bucket(waiting, n)
        return len(self._batch)

    def _bucket(self, waiting: Sequence[Request], n: int) -> list[Request]:
        """The oldest request plus the waiting ones whose length is within the threshold of it,
        nearest lengths first."""
        head = waiting[0]
        low = head.num_prompt_tokens / self.config.dynamic_padding_threshold
        high = head.num_prompt_tokens * self.config.dynamic_padding_threshold
        peers = [r for r in list(waiting)[1:] if low <= r.num_prompt_tokens <= math.ceil(high)]
        peers.sort(key=lambda r: abs(r.num_prompt_tokens - head.num_prompt_tokens))
        return [head] + peers[: n - 1]

    def next_candidate(self, waiting) -> Request:
        return self._batch.pop(0) if self._batch else waiting[0]


GATES = {"inflight": InflightGate, "none": NoBatchingGate, "static": StaticGate, "dynamic": DynamicGate}


def make_gate(config: EngineConfig) -> BatchingGate:
    return GATES[config.batching_mode](config)
