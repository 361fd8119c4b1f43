"""Telling a caller where its request stands (`return_queue_info`): while it waits, its place in
the queue and, under guaranteed_no_evict with backfill, the engine step its start is reserved for;
once it runs, the KV blocks reserved for it; its times; and while it waits, the expected seconds
until it starts (backend/sched/drain.py). No torch here.

Only requests added with `queue_info=True` are followed (their first completion), so the cost is
nothing for the others and O(waiting) a step while any followed request waits. A followed request
gets a `QueueInfo` on every output, and an output of its own (no tokens) at a step where what it
would be told changed (it arrived, moved up, got a reservation, started) and it sampled nothing.
"""
from __future__ import annotations

from typing import Optional

from backend.core.outputs import QueueInfo, RequestOutput
from backend.core.request import Request, RequestStatus
from backend.sched.drain import DrainEstimator
from backend.sched.scheduler import Scheduler


class QueueReporter:
    def __init__(self, scheduler: Scheduler, drain: Optional[DrainEstimator] = None):
        self.scheduler = scheduler
        self.drain = drain  # the expected wait of a waiting request
        self._followed: dict[str, Request] = {}
        self._told: dict[str, tuple] = {}  # seq_id -> (position, reserved step, blocks) last told

    def follow(self, req: Request) -> None:
        if req.reports_queue and req.index == 0:
            self._followed[req.seq_id] = req

    def report(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Attach QueueInfo to the followed requests' outputs, and add an output for each followed
        request that sampled nothing this step but whose standing changed."""
        if not self._followed:
            return outputs
        sched = self.scheduler
        positions = {r.seq_id: i for i, r in enumerate(sched.waiting)} if any(
            r.status is RequestStatus.WAITING for r in self._followed.values()) else {}
        reservation = sched.reservation
        by_seq = {(o.request_id, o.index): o for o in outputs}
        extra = []
        for seq_id, req in list(self._followed.items()):
            info = self._info(req, positions.get(seq_id, -1),
                              reservation.step if reservation and reservation.seq_id == seq_id else None)
            out = by_seq.get((req.request_id, req.index))
            told = (info.position, info.reserved_step, info.kv_blocks_reserved)
            if out is not None:
                out.queue = info
            elif told != self._told.get(seq_id) and not req.status.finished:
                extra.append(RequestOutput(req.request_id, req.prompt_token_ids, [], list(req.output_token_ids),
                                           "", "", False, None, index=req.index, queue=info))
            self._told[seq_id] = told
            if req.status.finished:
                del self._followed[seq_id]
                self._told.pop(seq_id, None)
        return outputs + extra

    def _info(self, req: Request, position: int, reserved_step: Optional[int]) -> QueueInfo:
        started = req.first_scheduled_step is not None and req.status is not RequestStatus.WAITING
        blocks = self.scheduler.policy.reserved_for(req) if started else 0
        wait = 0.0 if started else self.drain.wait_of(req.seq_id, position) if self.drain and position >= 0 else None
        return QueueInfo(engine_step=self.scheduler.steps, position=position, reserved_step=reserved_step,
                         first_scheduled_step=req.first_scheduled_step, kv_blocks_reserved=blocks,
                         arrival_time=req.arrival_time, first_scheduled_time=req.admitted_time,
                         first_token_time=req.first_token_time, finished_time=req.finished_time,
                         expected_wait_seconds=wait)
