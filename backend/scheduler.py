"""The scheduler: in-flight (iteration-level) batching over a paged KV cache. No torch here.

Each step, `schedule()` forms one flat batch within the token budget:
  1. running requests first, oldest first: one token each when decoding, the next prompt chunk
     when their prefill is unfinished;
  2. then waiting requests, most urgent first (priority, then arrival), while the batching gate
     (batching.py), `max_num_seqs`, the token budget and the capacity policy (policies.py) let
     them start. Under `guaranteed_no_evict` with `enable_backfill`, a request that does not fit
     (the head) no longer stops admission: later ones may start when they cannot delay the head
     past its reservation (backfill.py). Without it, admission stops at the head, as TensorRT-LLM.
`postprocess()` appends the sampled tokens, detects the end of each request and frees its blocks.

Capacity (who may hold blocks) is the policy's; batch forming (who computes how many tokens) is
this class's. Request-level padded batches (static, dynamic) are `PaddedScheduler`
(padded_scheduler.py), built on this core. See docs/design.md, "Scheduling".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from backend.admission import Admission
from backend.batching import make_gate
from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.policies import make_policy
from backend.request import Request, RequestStatus
from backend.waiting_queue import WaitingQueue


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


class Scheduler(Admission):
    def __init__(self, config: EngineConfig, blocks: BlockManager, max_model_len: int):
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.policy = make_policy(config.batch_scheduler_policy, blocks)
        self.gate = make_gate(config)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens whose KV was reused instead of computed
        self._init_admission()

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
        self.waiting.push(request)

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

    def pop_released(self) -> list[Request]:
        """Requests whose padded batch ended (PaddedScheduler); in-flight batching holds none."""
        return []

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self.steps += 1
        budget = self.config.max_num_batched_tokens
        # The step a head was promised: keep a token of the budget for it, so running prefills
        # cannot crowd it out (backfill.py counts on a budget above max_num_seqs for this).
        held = 1 if self.reservation is not None and self.reservation[1] <= self.steps else 0
        budget -= held
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n == 0:
                i += 1
                continue
            grown, refund, earlier = self._grow_or_preempt(req, req.num_computed_tokens + n, out)
            budget += refund
            i -= earlier
            if not grown:
                continue  # req itself was preempted: the next running request is at i now
            self._add(out, req, n)
            budget -= n
            i += 1
        budget += held
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

    def _grow_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput) -> tuple[bool, int, int]:
        """Give req the blocks for num_tokens, preempting the least urgent running requests while
        they are short (max_utilization). Returns (req still runs, budget given back by victims
        already scheduled this step, how many of those were before req in the running list)."""
        refund = earlier = 0
        while not self.blocks.can_grow(req.seq_id, num_tokens):
            if not self.policy.may_preempt:
                raise AssertionError(f"{self.policy.name}: {req.seq_id} ran out of reserved blocks")
            victim = self._least_urgent()
            earlier += self.running.index(victim) < self.running.index(req)
            refund += self._evict(victim, out)
            if victim is req:
                return False, refund, earlier
        self.blocks.grow(req.seq_id, num_tokens)
        return True, refund, earlier

    def _evict(self, victim: Request, out: SchedulerOutput) -> int:
        """Preempt a running request, dropping any rows it has in this step; returns their tokens."""
        self.running.remove(victim)
        self._preempt(victim)
        out.preempted.append(victim)
        freed = 0
        for rows in (out.decodes, out.prefills):
            freed += sum(s.num_new_tokens for s in rows if s.request is victim)
            rows[:] = [s for s in rows if s.request is not victim]
        return freed

    def _preempt(self, req: Request) -> None:
        """Free req's blocks and queue it first; it recomputes its prompt and outputs later."""
        self.blocks.free(req.seq_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req)  # back in its (priority, arrival) place

    def _start(self, req: Request, num_tokens: int, now: float) -> None:
        if req.admitted_time is None:
            req.admitted_time = now
        self.waiting.remove(req)
        if num_tokens:
            self.blocks.grow(req.seq_id, num_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

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
            ended = req.grammar.advance(req, result.token) if req.grammar is not None else None  # structured outputs
            status = ended or self._stop_status(req, result.token)
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
