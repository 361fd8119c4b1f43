"""Request-level padded batches (`batching_mode` static and dynamic) on the in-flight core.

They exist to measure, on one engine, what in-flight batching buys over a server that runs one
padded `generate` call per batch. So a batch costs what a padded batch costs:
- it starts whole: every member is admitted at once (the capacity policy permitting), and nothing
  joins until it ends (the gate, batching.py, decides when the next one may start);
- each member's prompt is padded to the batch's longest prompt;
- a member that finishes "lingers": it keeps its slot and its blocks and decodes on, until no
  member runs;
- the padding is real compute: padding rows that the runner pushes through the model (attending
  to the member's context) but never stores in the cache and never samples.
When a batch ends its members are `released` together (the engine answers them then). No torch.
"""
from __future__ import annotations

from typing import Iterable

from backend.request import Request, RequestStatus
from backend.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


class PaddedScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lingering: list[Request] = []  # finished members that keep their slot until the batch ends
        self.pad_pending: dict[str, int] = {}  # prompt padding still to compute, per member
        self.released: list[Request] = []  # members whose batch ended, for the engine

    # -- the batch's life ---------------------------------------------------------------------
    def finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            request.status = status
            self.running.remove(request)
            self.lingering.append(request)  # keeps its slot and blocks until the batch ends
        else:
            if request in self.lingering:
                self.lingering.remove(request)
                request.status = status
            else:
                super().finish(request, status)
            self.blocks.free(request.seq_id)
            self.pad_pending.pop(request.seq_id, None)
        self._end_batch_if_done()

    def _preempt(self, req: Request) -> None:
        self.pad_pending.pop(req.seq_id, None)
        super()._preempt(req)
        self._end_batch_if_done()

    def _end_batch_if_done(self) -> None:
        """A batch ends when no member runs and no prompt padding is left to compute."""
        if self.running or not self.lingering or any(self.pad_pending.get(r.seq_id) for r in self.lingering):
            return
        for r in self.lingering:
            self.blocks.free(r.seq_id)
            self.pad_pending.pop(r.seq_id, None)
        self.released.extend(self.lingering)
        self.lingering.clear()

    def pop_released(self) -> list[Request]:
        """Members of batches that ended since the last call (finished, blocks freed)."""
        released, self.released = self.released, []
        return released

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.lingering or self.released)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.lingering)

    def holders(self) -> list[Request]:
        return self.running + self.lingering

    def iter_requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.lingering
        yield from self.waiting

    # -- forming a step -------------------------------------------------------------------------
    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Start a batch whole: every member is admitted now, even when this step's token budget
        covers only the first prompt chunks (the rest are computed over the next steps). Then pad
        every prompt to the longest one."""
        allowed = self.gate.num_to_admit(self.waiting, self.holders(), now)
        members = []
        while self.waiting and len(members) < allowed and len(self.running) < self.config.max_num_seqs:
            req = self.gate.next_candidate(self.waiting)
            n = self._chunk(req, budget) if budget > 0 else 0
            if not self.policy.can_admit(req, self.running, n):
                break
            self._start(req, n, now)
            members.append(req)
            if n:
                self._add(out, req, n)
                budget -= n
        longest = max((r.num_prompt_tokens for r in members), default=0)
        for r in members:
            if r.num_prompt_tokens < longest:
                self.pad_pending[r.seq_id] = longest - r.num_prompt_tokens
        return budget

    def _use_leftover_budget(self, out: SchedulerOutput, budget: int) -> None:
        """Padding rows within what is left of the token budget: first the prompt padding still
        owed, then one decode row for every member that finished but whose batch still runs."""
        for req in self.running + self.lingering:
            pending = self.pad_pending.get(req.seq_id, 0)
            if pending and budget > 0:
                n = min(pending, budget)
                # positions stay within the padded prompt (so within max_model_len)
                start = min(req.num_computed_tokens, req.num_prompt_tokens)
                out.padding.append(ScheduledSeq(req, start, n, padding=True))
                self.pad_pending[req.seq_id] = pending - n
                budget -= n
        for req in self.lingering:
            if budget > 0 and not self.pad_pending.get(req.seq_id):
                out.padding.append(ScheduledSeq(req, req.num_computed_tokens, 1, padding=True))
                budget -= 1

    def postprocess(self, out, sampled, now):
        finished = super().postprocess(out, sampled, now)
        self._end_batch_if_done()
        return finished

    def check_integrity(self) -> None:
        super().check_integrity()
        for r in self.lingering:
            assert r.status.finished, f"lingering {r.seq_id} is not finished"
        assert set(self.pad_pending) <= {r.seq_id for r in self.holders()}
