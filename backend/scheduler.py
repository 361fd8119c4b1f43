"""The scheduler: in-flight (iteration-level) batching over a paged KV cache. No torch here.

Each step, `schedule()` forms one flat batch within the token budget:
  1. running requests first, oldest first: one token each when decoding, the next prompt chunk
     when their prefill is unfinished;
  2. then waiting requests, first come first served, while the batching gate, `max_num_seqs`,
     the token budget and the capacity policy (policies.py) let them start.
`postprocess()` appends the sampled tokens, detects the end of each request and frees its blocks.

Request-level batches (`static`, `dynamic`: the gate's `pads`) are made to cost what a padded batch
costs. A batch starts whole; each member's prompt is padded to the batch's longest prompt; a member
that finishes "lingers": it keeps its slot and its blocks and decodes on, until no member runs.
The padding is real compute: `SchedulerOutput.padding` rows that the runner pushes through the
model (attending to the member's context) but never stores in the cache and never samples. When the
batch ends its members are `released` together (the engine answers them then).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from backend.batching import make_gate
from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.policies import make_policy
from backend.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # first position computed this step
    num_new_tokens: int
    padding: bool = False  # a padding row: computed for its cost only, never stored nor sampled

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return not self.padding and self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one query token each
    prefills: list[ScheduledSeq] = field(default_factory=list)  # chunks of several tokens
    preempted: list[Request] = field(default_factory=list)
    # Padded batches only: prompt padding and the decode steps of members that already finished.
    # Each row attends to its member's cached context from position `start` on; slot mapping -1.
    padding: list[ScheduledSeq] = field(default_factory=list)

    @property
    def seqs(self) -> list[ScheduledSeq]:
        """The real rows (padding excluded)."""
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs + self.padding)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.padding


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.policy = make_policy(config.batch_scheduler_policy, blocks)
        self.gate = make_gate(config)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens whose KV was reused instead of computed
        # Padded batches: finished members that keep their slot until the batch ends, prompt
        # padding still to compute per member, and members whose batch ended (for the engine).
        self.lingering: list[Request] = []
        self.pad_pending: dict[str, int] = {}
        self.released: list[Request] = []

    # -- arrivals and aborts ------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse, with the numbers, a request that could never run to completion."""
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the KV "
                f"cache ({capacity} tokens = {self.blocks.num_blocks} blocks of {self.blocks.block_size})")
        if not self.config.enable_chunked_context and prompt_len > self.config.max_num_batched_tokens:
            raise ValueError(
                f"prompt ({prompt_len} tokens) exceeds max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) and enable_chunked_context is off")

    def add(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Optional[Request]:
        for queue in (self.running, self.lingering, self.waiting):
            for r in queue:
                if r.request_id == request_id:
                    self.finish(r, RequestStatus.FINISHED_ABORTED)
                    return r
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
            if self.gate.pads and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.lingering.append(request)  # keeps its slot and blocks until the batch ends
                self._end_batch_if_done()
                return
        elif request in self.lingering:
            self.lingering.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pad_pending.pop(request.request_id, None)
        self.blocks.free(request.request_id)
        self._end_batch_if_done()

    def _end_batch_if_done(self) -> None:
        """A padded batch ends when no member runs and no prompt padding is left to compute."""
        if self.running or not self.lingering or any(self.pad_pending.get(r.request_id) for r in self.lingering):
            return
        for r in self.lingering:
            self.blocks.free(r.request_id)
            self.pad_pending.pop(r.request_id, None)
        self.released.extend(self.lingering)
        self.lingering.clear()

    def pop_released(self) -> list[Request]:
        """Members of padded batches that ended since the last call (finished, blocks freed)."""
        released, self.released = self.released, []
        return released

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.lingering or self.released)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n == 0:
                i += 1
                continue
            if not self._grow_or_preempt(req, req.num_computed_tokens + n, out):
                break  # req itself was preempted; everything newer already was
            self._add(out, req, n)
            budget -= n
            i += 1
        if not out.preempted:
            budget = self._admit(out, budget, now)
        if self.gate.pads:
            self._schedule_padding(out, budget)
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        """How many of req's uncomputed tokens this step may take."""
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining <= budget:
            return remaining
        chunked = self.config.enable_chunked_context or remaining > self.config.max_num_batched_tokens
        return budget if chunked else 0

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> None:
        seq = ScheduledSeq(req, req.num_computed_tokens, n)
        (out.decodes if n == 1 else out.prefills).append(seq)

    def _grow_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.blocks.can_grow(req.request_id, num_tokens):
            if not self.policy.may_preempt:
                raise AssertionError(f"{self.policy.name}: {req.request_id} ran out of reserved blocks")
            victim = self.running.pop()  # the newest running request
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        self.blocks.grow(req.request_id, num_tokens)
        return True

    def _preempt(self, req: Request) -> None:
        """Free req's blocks and queue it first; it recomputes its prompt and outputs later."""
        self.blocks.free(req.request_id)
        self.pad_pending.pop(req.request_id, None)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._end_batch_if_done()

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        allowed = self.gate.num_to_admit(self.waiting, self.running + self.lingering, now)
        if self.gate.pads:
            return self._admit_batch(out, budget, allowed)
        while self.waiting and allowed > 0 and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.gate.next_candidate(self.waiting)
            req.num_computed_tokens = self.blocks.reuse_prefix(req.request_id, req.all_token_ids)
            n = self._chunk(req, budget)
            if n == 0 or not self.policy.can_admit(req, self.running, req.num_computed_tokens + n):
                self.blocks.free(req.request_id)  # give back a reused prefix; it stays cached
                req.num_computed_tokens = 0
                break  # first come first served: no skipping past a request that does not fit
            self.waiting.remove(req)
            self.prefix_hit_tokens += req.num_computed_tokens
            self.blocks.grow(req.request_id, req.num_computed_tokens + n)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add(out, req, n)
            budget -= n
            allowed -= 1
        return budget

    def _admit_batch(self, out: SchedulerOutput, budget: int, allowed: int) -> int:
        """Start a request-level batch whole: every member is admitted now (the capacity policy
        permitting), even when this step's token budget covers only the first prompt chunks; the
        rest are computed over the next steps. Then pad every prompt to the longest one."""
        members = []
        while self.waiting and len(members) < allowed and len(self.running) < self.config.max_num_seqs:
            req = self.gate.next_candidate(self.waiting)
            n = self._chunk(req, budget) if budget > 0 else 0
            if not self.policy.can_admit(req, self.running, n):
                break
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            members.append(req)
            if n:
                self.blocks.grow(req.request_id, n)
                self._add(out, req, n)
                budget -= n
        longest = max((r.num_prompt_tokens for r in members), default=0)
        for r in members:
            if r.num_prompt_tokens < longest:
                self.pad_pending[r.request_id] = longest - r.num_prompt_tokens
        return budget

    def _schedule_padding(self, out: SchedulerOutput, budget: int) -> None:
        """Padding rows within what is left of the token budget: first the prompt padding still
        owed, then one decode row for every member that finished but whose batch still runs."""
        for req in self.running + self.lingering:
            pending = self.pad_pending.get(req.request_id, 0)
            if pending and budget > 0:
                n = min(pending, budget)
                # positions stay within the padded prompt (so within max_model_len)
                start = min(req.num_computed_tokens, req.num_prompt_tokens)
                out.padding.append(ScheduledSeq(req, start, n, padding=True))
                self.pad_pending[req.request_id] = pending - n
                budget -= n
        for req in self.lingering:
            if budget > 0 and not self.pad_pending.get(req.request_id):
                out.padding.append(ScheduledSeq(req, req.num_computed_tokens, 1, padding=True))
                budget -= 1

    # -- after the model ran ------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[str, int], now: float) -> list[Request]:
        """Record computed tokens and sampled ones; return the requests that finished this step."""
        finished = []
        for seq in out.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = seq.start + seq.num_new_tokens
            if self.blocks.enable_prefix_caching:
                self.blocks.register_computed(req.request_id, req.all_token_ids, req.num_computed_tokens)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._stop_status(req, token)
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        self.gate.after_step(self.running)
        self._end_batch_if_done()
        return finished

    def _stop_status(self, req: Request, token: int) -> Optional[RequestStatus]:
        n_out = len(req.output_token_ids)
        if n_out >= req.params.min_tokens and (
                token in req.eos_token_ids or token in req.params.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if n_out >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        ids = [r.request_id for r in self.running + self.lingering] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert len(self.running) + len(self.lingering) <= self.config.max_num_seqs
        assert not self.lingering or self.gate.pads, "only padded batches keep finished members"
        for r in self.lingering:
            assert r.status.finished, f"lingering {r.request_id} is not finished"
        assert set(self.pad_pending) <= {r.request_id for r in self.running + self.lingering}
        for r in self.waiting:
            assert self.blocks.num_blocks_of(r.request_id) == 0, f"waiting {r.request_id} holds blocks"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            assert self.blocks.num_blocks_of(r.request_id) * self.blocks.block_size >= r.num_computed_tokens
        self.policy.check_invariant(self.running + self.lingering)

    def iter_requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.lingering
        yield from self.waiting
