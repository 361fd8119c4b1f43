"""Who waits and who runs, and every move between them: start, finish, preempt. No torch here.

Batch forming (scheduler.py) and admission (admission.py) both work on one `RequestPool`: it owns
the waiting queue and the running list, and is the only place a request changes queue or gives
back its KV blocks. Padded batches keep finished members in the pool until their batch ends
(`PaddedPool`, padded.py).
"""
from __future__ import annotations

import time
from typing import Iterable

from backend.kv.groups import KVCacheGroups
from backend.core.request import Request, RequestStatus
from backend.sched.policies import CapacityPolicy
from backend.sched.batch import SchedulerOutput
from backend.sched.waiting_queue import WaitingQueue


class RequestPool:
    def __init__(self, blocks: KVCacheGroups, policy: CapacityPolicy):
        self.blocks = blocks
        self.policy = policy
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # since the last step plan (step_plan.py): the sequences that left, and those preempted
        self.left: list[Request] = []
        self.preempted: list[Request] = []

    # -- moves ----------------------------------------------------------------------------------
    def start(self, req: Request, num_tokens: int, now: float, step: int) -> None:
        """A waiting request starts running at engine step `step`, holding the blocks for its first
        num_tokens."""
        if req.admitted_time is None:
            req.admitted_time, req.first_scheduled_step = now, step
        self.waiting.remove(req)
        if num_tokens:
            self.blocks.grow(req.seq_id, num_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.policy.started(req)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (any status), freeing its blocks. Finishing a finished request only
        changes its reason (a stop string that completed on the last allowed token)."""
        if request.status.finished:
            request.status = status
            return
        request.status = status
        request.finished_time = time.monotonic()
        self.left.append(request)
        if request in self.running:
            self.running.remove(request)
            self.policy.released(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._drop_load(request)
        self.blocks.free(request.seq_id)

    def preempt(self, req: Request) -> None:
        """Free a running request's blocks and queue it again in its (priority, arrival) place; it
        recomputes its prompt and outputs later."""
        self.running.remove(req)
        self.policy.released(req)
        self._drop_load(req)
        self.blocks.free(req.seq_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(req)
        self.waiting.push(req)

    @staticmethod
    def _drop_load(req: Request) -> None:
        """A prefix on its way back from a lower tier is given up with the blocks it was going to."""
        if req.kv_load is not None:
            req.kv_load.cancel()
            req.kv_load = None

    def evict(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt a running request and drop its rows from this step; returns their tokens."""
        self.preempt(victim)
        out.preempted.append(victim)
        return out.drop(victim)

    def least_urgent(self) -> Request:
        """The running request to preempt: the least urgent, the newest among equals (vLLM)."""
        return max(reversed(self.running), key=lambda r: r.priority)

    def take_changes(self) -> tuple[list[Request], list[Request]]:
        """(the requests that left, those preempted) since the last call: the step plan's news."""
        changes = self.left, self.preempted
        self.left, self.preempted = [], []
        return changes

    # -- views ----------------------------------------------------------------------------------
    def holders(self) -> list[Request]:
        """Requests that hold KV blocks."""
        return list(self.running)

    def iter_requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def check_integrity(self, max_num_seqs: int) -> None:
        self.blocks.check_integrity()
        ids = [r.seq_id for r in self.iter_requests()]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert self.num_running <= max_num_seqs
        for r in self.waiting:
            assert self.blocks.num_blocks_of(r.seq_id) == 0, f"waiting {r.seq_id} holds blocks"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            assert self.blocks.table_tokens(r.seq_id) >= r.num_computed_tokens
        self.policy.check_invariant(self.holders())
