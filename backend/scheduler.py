"""The scheduler: in-flight (iteration-level) batching over a paged KV cache. No torch here.

Each step, `schedule()` forms one flat batch within the token budget:
  1. running requests first, oldest first: one token each when decoding, the next prompt chunk
     when their prefill is unfinished;
  2. then waiting requests, first come first served, while the batching gate (batching.py),
     `max_num_seqs`, the token budget and the capacity policy (policies.py) let them start.
`postprocess()` appends the sampled tokens, detects the end of each request and frees its blocks.

Capacity (who may hold blocks) is the policy's; batch forming (who computes how many tokens) is
this class's. Request-level padded batches (static, dynamic) are `PaddedScheduler`
(padded_scheduler.py), built on this core. See docs/design.md, "Scheduling".
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

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
    block_table: list[int] = field(default_factory=list)  # the sequence's blocks, for the runner

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return not self.padding and self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step's batch: everything the runner needs (tokens come from the requests, blocks from
    each row's `block_table`), so the runner never asks the block manager."""
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one query token each
    prefills: list[ScheduledSeq] = field(default_factory=list)  # chunks of several tokens
    preempted: list[Request] = field(default_factory=list)
    # Padded batches only: rows computed for their cost, attending to their member's cached context
    # from `start` on; never stored (slot -1), never sampled.
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

    # -- arrivals and aborts ------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """Refuse, with the numbers, a request that could never run to completion."""
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                             f"max_model_len ({self.max_model_len})")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if self.blocks.blocks_for(total - 1) > self.blocks.num_blocks:  # the last token is never stored
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the KV "
                             f"cache ({capacity} tokens = {self.blocks.num_blocks} blocks of {self.blocks.block_size})")
        if not self.config.enable_chunked_context and prompt_len > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt ({prompt_len} tokens) exceeds max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) and enable_chunked_context is off")
        if n > self.config.max_num_seqs:
            raise ValueError(f"n ({n}) exceeds max_num_seqs ({self.config.max_num_seqs})")

    def add(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens, request.params.n)
        self.waiting.append(request)

    def abort(self, request_id: str) -> list[Request]:
        """Abort every sequence of the request (all n completions); returns them."""
        found = [r for r in self.iter_requests() if r.request_id == request_id]
        for r in found:
            self.finish(r, RequestStatus.FINISHED_ABORTED)
        return found

    def finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

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
        self._use_leftover_budget(out, budget)
        self._attach_block_tables(out)
        return out

    def _use_leftover_budget(self, out: SchedulerOutput, budget: int) -> None:
        """In-flight batching leaves it unused (padded batches spend it on padding rows)."""

    def _chunk(self, req: Request, budget: int) -> int:
        """How many of req's uncomputed tokens this step may take."""
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining <= budget:
            return remaining
        chunked = self.config.enable_chunked_context or remaining > self.config.max_num_batched_tokens
        return budget if chunked else 0

    @staticmethod
    def _add(out: SchedulerOutput, req: Request, n: int) -> None:
        seq = ScheduledSeq(req, req.num_computed_tokens, n)
        (out.decodes if n == 1 else out.prefills).append(seq)

    def _attach_block_tables(self, out: SchedulerOutput) -> None:
        for s in out.seqs + out.padding:
            s.block_table = self.blocks.block_table(s.request.seq_id)

    def _grow_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.blocks.can_grow(req.seq_id, num_tokens):
            if not self.policy.may_preempt:
                raise AssertionError(f"{self.policy.name}: {req.seq_id} ran out of reserved blocks")
            victim = self.running.pop()  # the newest running request
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        self.blocks.grow(req.seq_id, num_tokens)
        return True

    def _preempt(self, req: Request) -> None:
        """Free req's blocks and queue it first; it recomputes its prompt and outputs later."""
        self.blocks.free(req.seq_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        allowed = self.gate.num_to_admit(self.waiting, self.holders(), now)
        while self.waiting and allowed > 0 and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.gate.next_candidate(self.waiting)
            if self._waits_for_sibling(req):
                break
            req.num_computed_tokens = self._reuse_computed(req)
            n = self._chunk(req, budget)
            if n == 0 or not self.policy.can_admit(req, self.running, req.num_computed_tokens + n):
                self.blocks.free(req.seq_id)  # give back a reused prefix; it stays cached
                req.num_computed_tokens = 0
                break  # first come first served: no skipping past a request that does not fit
            self._start(req, req.num_computed_tokens + n)
            self.prefix_hit_tokens += req.num_computed_tokens
            self._add(out, req, n)
            budget -= n
            allowed -= 1
        return budget

    def _start(self, req: Request, num_tokens: int) -> None:
        self.waiting.remove(req)
        if num_tokens:
            self.blocks.grow(req.seq_id, num_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    # -- n > 1: the completions of one prompt share its KV ------------------------------------
    def _first_sibling(self, req: Request) -> Optional[Request]:
        if req.index == 0:
            return None
        return next((r for r in self.running if r.request_id == req.request_id and r.index == 0), None)

    def _waits_for_sibling(self, req: Request) -> bool:
        """A later completion waits until the first one has computed the prompt it will share."""
        if req.index == 0:
            return False
        first = self._first_sibling(req)
        if first is None:
            first = next((r for r in self.waiting if r.request_id == req.request_id and r.index == 0), None)
            return first is not None
        return first.num_computed_tokens < req.num_prompt_tokens - 1

    def _reuse_computed(self, req: Request) -> int:
        """Tokens already in the cache for req: its first sibling's full prompt blocks, shared, or
        a cached prefix (enable_kv_cache_reuse). The last prompt token is always computed again, so
        that its logits give the first token."""
        first = self._first_sibling(req)
        if first is not None:
            return self.blocks.fork(first.seq_id, req.seq_id, req.num_prompt_tokens - 1)
        return self.blocks.reuse_prefix(req.seq_id, req.all_token_ids)

    # -- after the model ran ------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: Mapping[str, object], now: float) -> list[Request]:
        """Record computed tokens and sampled ones (`sampled`: seq_id -> an object with .token);
        return the requests that finished this step."""
        finished = []
        for seq in out.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = seq.start + seq.num_new_tokens
            if self.blocks.enable_prefix_caching:
                self.blocks.register_computed(req.seq_id, req.all_token_ids, req.num_computed_tokens)
            result = sampled.get(req.seq_id)
            if result is None:
                continue
            req.output_token_ids.append(result.token)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._stop_status(req, result.token)
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        self.gate.after_step(self.running)
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
        ids = [r.seq_id for r in self.iter_requests()]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert self.num_running <= self.config.max_num_seqs
        for r in self.waiting:
            assert self.blocks.num_blocks_of(r.seq_id) == 0, f"waiting {r.seq_id} holds blocks"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            assert self.blocks.num_blocks_of(r.seq_id) * self.blocks.block_size >= r.num_computed_tokens
        self.policy.check_invariant(self.holders())

    def holders(self) -> list[Request]:
        """Requests that hold KV blocks."""
        return list(self.running)

    def iter_requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting


def make_scheduler(config: EngineConfig, blocks: BlockManager, max_model_len: int) -> Scheduler:
    """The in-flight core, or the padded request-level batches (static, dynamic) built on it."""
    if make_gate(config).pads:
        from backend.padded_scheduler import PaddedScheduler
        return PaddedScheduler(config, blocks, max_model_len)
    return Scheduler(config, blocks, max_model_len)
