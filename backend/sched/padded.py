"""Request-level padded batches (`batching_mode` static and dynamic) on the in-flight core.

They exist to measure, on one engine, what in-flight batching buys over a server that runs one
padded `generate` call per batch. So a batch costs what a padded batch costs:
- it starts whole: every member is admitted at once (the capacity policy permitting), and nothing
  joins until it ends (the gate, batching.py, decides when the next one may start);
- each member's prompt is padded to the batch's longest prompt;
- a member that finishes "lingers": it keeps its slot and its blocks and decodes on, until no
  member runs;
- the padding is real compute: padding rows that the runner pushes through the model (attending
  to the member's context) but never stores in the cache and never samples;
- every member is answered when the batch ends, as one padded generate call would answer: its
  outputs are held here until then (aborts and errors answer at once).
Everything about padded batches is in this module and the gates; the engine sees a `Scheduler`.
No torch here.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterable

from backend.core.outputs import CoreOutput, merge_outputs
from backend.core.request import Request, RequestStatus, seq_id_of
from backend.sched.admission import Admission, chunk
from backend.sched.pool import RequestPool
from backend.sched.scheduler import Scheduler
from backend.sched.batch import ScheduledSeq, SchedulerOutput

_ENDS_NORMALLY = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class PaddedPool(RequestPool):
    """The pool, with finished members kept (`lingering`) until their batch ends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lingering: list[Request] = []  # finished members that keep their slot until the batch ends
        self.pad_pending: dict[str, int] = {}  # prompt padding still to compute, per member
        self.released: list[Request] = []  # members whose batch ended, for the engine

    def finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.lingering and status in _ENDS_NORMALLY:
            request.status = status  # a new reason for a finished member (a stop string at the end)
        elif request in self.running and status in _ENDS_NORMALLY:
            request.status = status
            request.finished_time = time.monotonic()
            self.running.remove(request)
            self.lingering.append(request)  # keeps its slot and blocks until the batch ends
        else:
            if request in self.lingering:
                self.lingering.remove(request)
                self.policy.released(request)
                request.status = status
                self.left.append(request)
            else:
                super().finish(request, status)
            self.blocks.free(request.seq_id)
            self.pad_pending.pop(request.seq_id, None)
        self.end_batch_if_done()

    def preempt(self, req: Request) -> None:
        self.pad_pending.pop(req.seq_id, None)
        super().preempt(req)
        self.end_batch_if_done()

    def end_batch_if_done(self) -> None:
        """A batch ends when no member runs and no prompt padding is left to compute."""
        if self.running or not self.lingering or any(self.pad_pending.get(r.seq_id) for r in self.lingering):
            return
        for r in self.lingering:
            self.policy.released(r)
            self.blocks.free(r.seq_id)
            self.pad_pending.pop(r.seq_id, None)
        self.released.extend(self.lingering)
        self.left.extend(self.lingering)
        self.lingering.clear()

    def pop_released(self) -> list[Request]:
        """Members of batches that ended since the last call (finished, blocks freed)."""
        released, self.released = self.released, []
        return released

    def holders(self) -> list[Request]:
        return self.running + self.lingering

    def iter_requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.lingering
        yield from self.waiting

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.lingering)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.lingering or self.released)

    def check_integrity(self, max_num_seqs: int) -> None:
        super().check_integrity(max_num_seqs)
        for r in self.lingering:
            assert r.status.finished, f"lingering {r.seq_id} is not finished"
        assert set(self.pad_pending) <= {r.seq_id for r in self.holders()}


class PaddedAdmission(Admission):
    """Start a batch whole: every member is admitted now, even when this step's token budget covers
    only the first prompt chunks (the rest are computed over the next steps). Then pad every prompt
    to the longest one."""
    pool: PaddedPool

    def admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        pool = self.pool
        allowed = self.gate.num_to_admit(pool.waiting, pool.holders(), now)
        members = []
        slots = self.lora_slots
        if slots is not None:
            slots.begin(pool.running)
        while pool.waiting and len(members) < allowed and len(pool.running) < self.config.max_num_seqs:
            req = self.gate.next_candidate(pool.waiting)
            n = chunk(req, budget, self.config) if budget > 0 else 0
            if not self.policy.can_admit(req, n) or (slots is not None and not slots.may_start(req)):
                break  # (a request whose LoRA adapter finds no slot starts a later batch)
            pool.start(req, n, now, self.steps)
            if slots is not None:
                slots.started(req)
            members.append(req)
            if n:
                out.add(req, n)
                budget -= n
        longest = max((r.num_prompt_tokens for r in members), default=0)
        for r in members:
            if r.num_prompt_tokens < longest:
                pool.pad_pending[r.seq_id] = longest - r.num_prompt_tokens
        return budget


class PaddedScheduler(Scheduler):
    pool: PaddedPool

    def __init__(self, config, blocks, max_model_len, gate, policy):
        pool = PaddedPool(blocks, policy)
        super().__init__(config, blocks, max_model_len, gate, pool, PaddedAdmission(config, pool, gate))
        self._held: dict[str, CoreOutput] = {}

    def _use_leftover_budget(self, out: SchedulerOutput, budget: int) -> None:
        """Padding rows within what is left of the token budget: first the prompt padding still
        owed, then one decode row for every member that finished but whose batch still runs."""
        pool = self.pool
        for req in pool.running + pool.lingering:
            pending = pool.pad_pending.get(req.seq_id, 0)
            if pending and budget > 0:
                n = min(pending, budget)
                # positions stay within the padded prompt (so within max_model_len)
                start = min(req.num_computed_tokens, req.num_prompt_tokens)
                out.padding.append(ScheduledSeq(req, start, n, padding=True))
                pool.pad_pending[req.seq_id] = pending - n
                budget -= n
        for req in pool.lingering:
            if budget > 0 and not pool.pad_pending.get(req.seq_id):
                out.padding.append(ScheduledSeq(req, req.num_computed_tokens, 1, padding=True))
                budget -= 1

    def postprocess(self, out, sampled, now):
        finished = super().postprocess(out, sampled, now)
        self.pool.end_batch_if_done()
        return finished

    def deliver(self, outputs: list[CoreOutput]) -> list[CoreOutput]:
        """Hold each member's outputs, merged, until its batch ends; aborts and errors answer at
        once (a member that had already finished answers with what it held and the new reason)."""
        ready = []
        for o in outputs:
            key = seq_id_of(o.request_id, o.index)
            held = self._held.pop(key, None)
            if o.finished and o.finish_reason in ("abort", "error"):
                ready.append(dataclasses.replace(held, finish_reason=o.finish_reason, error=o.error)
                             if held is not None and held.finished else merge_outputs(held, o))
            else:
                self._held[key] = merge_outputs(held, o)
        ready.extend(self._held.pop(r.seq_id) for r in self.pool.pop_released() if r.seq_id in self._held)
        return ready
