"""Batching gates: when waiting requests may join the running batch (`batching_mode`).

They exist to compare, on one engine and one workload, what each way of batching buys:
  inflight  iteration level: requests join at any step (the default);
  none      one request at a time;
  static    a batch of N starts once N wait or the oldest waited max_queue_delay; nothing joins
            until every member has finished;
  dynamic   request-level batches of up to max_num_seqs that wait at most max_queue_delay, formed
            from one length bucket (prompt lengths within dynamic_padding_threshold of each other),
            run to completion before the next batch starts.

static and dynamic are request-level batches (`pads = True`), and the scheduler makes them cost what
a padded batch costs (HF `generate` on a padded batch): every member's prompt is padded to the
batch's longest prompt, a member that finishes keeps its slot and its blocks and keeps decoding
until the batch's longest member finishes, and the engine answers all members when the batch ends.
The padding is computed for real (padding rows, never stored in the KV cache, never sampled).
No torch here.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from backend.core.config import EngineConfig
from backend.core.request import Request

UNLIMITED = 1 << 30


class BatchingGate:
    pads = False  # request-level batches: padded prompts, run to the longest member, answered at the end

    def __init__(self, config: EngineConfig):
        self.config = config
        self.delay_s = config.max_queue_delay_microseconds / 1e6

    def num_to_admit(self, waiting: Sequence[Request], running: Sequence[Request], now: float) -> int:
        """How many waiting requests may start now; `running` also holds a padded batch's members
        that finished and wait for the batch to end."""
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
    pads = True

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
        """The oldest request plus waiting ones of the nearest prompt lengths, as long as the
        bucket's longest prompt stays within dynamic_padding_threshold x its shortest (so no member
        is padded by more than that factor)."""
        head = waiting[0]
        threshold = self.config.dynamic_padding_threshold
        lo = hi = head.num_prompt_tokens
        bucket = [head]
        peers = sorted(list(waiting)[1:], key=lambda r: abs(r.num_prompt_tokens - head.num_prompt_tokens))
        for r in peers:
            if len(bucket) >= n:
                break
            new_lo, new_hi = min(lo, r.num_prompt_tokens), max(hi, r.num_prompt_tokens)
            if new_hi <= math.floor(threshold * new_lo + 1e-9):
                bucket.append(r)
                lo, hi = new_lo, new_hi
        return bucket

    def next_candidate(self, waiting) -> Request:
        return self._batch.pop(0) if self._batch else waiting[0]


GATES = {"inflight": InflightGate, "none": NoBatchingGate, "static": StaticGate, "dynamic": DynamicGate}


def make_gate(config: EngineConfig) -> BatchingGate:
    return GATES[config.batching_mode](config)
