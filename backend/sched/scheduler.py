"""The scheduler: in-flight (iteration-level) batching over a paged KV cache. No torch here.

Each step, `schedule()` forms one flat batch within the token budget:
  1. running requests first, oldest first: one token each when decoding, the next prompt chunk
     when their prefill is unfinished;
  2. then waiting requests, most urgent first (priority, then arrival), while the batching gate
     (batching.py), `max_num_seqs`, the token budget and the capacity policy (policies.py) let
     them start (admission.py). Under `guaranteed_no_evict` with `enable_backfill`, a request
     that does not fit (the head) no longer stops admission: later ones may start when they cannot
     delay the head past its reservation (backfill.py). Without it, admission stops at the head,
     as TensorRT-LLM.
`plan()` turns the batch into the step plan the worker runs (step_plan.py: deltas by sequence id,
the grammar bitmask, the KV tiers' copies); `postprocess()` appends the sampled tokens, detects the
end of each request and frees its blocks.

Capacity (who may hold blocks) is the policy's; who waits and runs is the pool's (pool.py); which
waiting requests start is the admission's; batch forming (who computes how many tokens) is this
class's. Request-level padded batches (static, dynamic) are `PaddedScheduler` (padded.py);
`make_scheduler` (factory.py) picks one. See docs/design.md, "Scheduling".
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from backend.kv.groups import KVCacheGroups
from backend.core.config import EngineConfig
from backend.core.multimodal import keyed_tokens
from backend.core.request import Request, RequestStatus
from backend.sched.admission import Admission, chunk
from backend.sched.batching import BatchingGate, make_gate
from backend.sched.policies import make_policy
from backend.sched.pool import RequestPool
from backend.core.step import StepPlan
from backend.sched.batch import ScheduledSeq, SchedulerOutput
from backend.sched.grammar import step_masks
from backend.sched.pacing import Pacer
from backend.sched.step_cost import StepCost, step_features
from backend.sched.speculation import attach_drafts, draft_room
from backend.sched.step_plan import WorkerView


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: KVCacheGroups, max_model_len: int,
                 gate: Optional[BatchingGate] = None, pool: Optional[RequestPool] = None,
                 admission: Optional[Admission] = None, tiers=None):
        """The in-flight scheduler; padded batches pass their own gate, pool and admission.
        `tiers`: the KV tiers (backend/kv/tiers/manager.KVTiers) when they are on: admission brings
        a prefix back from them, and each plan carries their copies."""
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.gate = gate or make_gate(config)
        self.pool = pool or RequestPool(blocks, make_policy(config.batch_scheduler_policy, blocks))
        self.policy = self.pool.policy
        self.tiers = tiers
        # The engine's model of its step time (pacing.py): the pacer's, and admission's price of a
        # prompt token when it weighs a tier's copy against computing a prefix again (tier_choice.py).
        self.step_cost = StepCost()
        self.admission = admission or Admission(config, self.pool, self.gate, tiers, self.step_cost)
        self.worker_view = WorkerView(blocks)  # what the worker knows of each sequence (step_plan.py)
        # Prefill pacing (pacing.py): prompt chunks beside decode rows capped to an inter-token
        # target. Only a chunked prompt can be paced; padded batches (padded.py) never are.
        self.pacer = Pacer(config.inter_token_target_ms, config.inter_token_auto_factor, self.step_cost) \
            if config.enable_chunked_context and config.batching_mode == "inflight" else None
        self.last_step_seconds = 0.0  # between the last two schedule() calls: scheduler_delay_factor's unit
        self._last_schedule: Optional[float] = None

    # What the engine, its metrics and the tests read.
    waiting = property(lambda self: self.pool.waiting)
    running = property(lambda self: self.pool.running)
    num_preemptions = property(lambda self: self.pool.num_preemptions)
    num_backfilled = property(lambda self: self.admission.num_backfilled)
    prefix_hit_tokens = property(lambda self: self.admission.prefix_hit_tokens)
    steps = property(lambda self: self.admission.steps)
    reservation = property(lambda self: self.admission.reservation)

    def observe_step(self, decode_rows: int, prompt_tokens: int, pairs: float, seconds: float,
                     decode_kv: float = 0.0) -> None:
        """A step the worker ran (step_cost.batch_shape) and its wall time: the step model learns."""
        if self.pacer is not None:
            self.pacer.observe(decode_rows, prompt_tokens, pairs, seconds, decode_kv)  # (its cost is step_cost)
        else:
            self.step_cost.observe(step_features(decode_rows, prompt_tokens, pairs, decode_kv), seconds)

    # -- arrivals and aborts ------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int, n: int = 1, pooling: bool = False) -> None:
        """Refuse, with the numbers, a request that could never run to completion. A pooling request
        (max_tokens 1: its prompt's KV only) may fill max_model_len."""
        total = prompt_len + max_tokens
        if pooling and prompt_len > self.max_model_len:
            raise ValueError(f"the input has {prompt_len} tokens; max_model_len is {self.max_model_len}")
        if total > self.max_model_len + pooling:
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
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens, request.params.n, request.pooling is not None)
        self.admission.arrived(request)
        self.pool.waiting.push(request)

    def abort(self, request_id: str) -> list[Request]:
        """Abort every sequence of the request (all n completions); returns them."""
        found = [r for r in self.pool.iter_requests() if r.request_id == request_id]
        for r in found:
            self.finish(r, RequestStatus.FINISHED_ABORTED)
        return found

    def finish(self, request: Request, status: RequestStatus) -> None:
        self.pool.finish(request, status)

    def deliver(self, outputs: list) -> list:
        """The outputs to hand out now: all of them (padded batches hold theirs; padded.py)."""
        return outputs

    has_work = property(lambda self: self.pool.has_work)
    num_running = property(lambda self: self.pool.num_running)

    def holders(self) -> list[Request]:
        return self.pool.holders()

    def iter_requests(self) -> Iterable[Request]:
        return self.pool.iter_requests()

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self.admission.steps += 1
        if self._last_schedule is not None:
            self.last_step_seconds = now - self._last_schedule
        self._last_schedule = now
        if self.tiers is not None:  # KV tiers: loads that landed let their requests run now
            self.tiers.poll()
        budget = self.config.max_num_batched_tokens
        self.admission.encoder.reset()  # the step's image tokens to encode (docs/vision.md)
        held = self.admission.held_token()
        budget -= held
        running = self.pool.running
        prompt_left = self._prompt_cap(running)  # None: not paced this step
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if not self.admission.ready(req):
                i += 1  # its prefix is on its way back from a lower tier, or a parked beam (admission.py)
                continue
            decoding = req.num_tokens - req.num_computed_tokens == 1
            self.admission.encoder.room = budget  # a paced chunk may still take an image whole
            n = chunk(req, budget if decoding or prompt_left is None else min(budget, prompt_left), self.config,
                      self.admission.encoder)
            if n == 0:
                i += 1
                continue
            grown, refund, earlier = self._grow_or_preempt(req, req.num_computed_tokens + n, out)
            budget += refund
            i -= earlier
            if not grown:
                continue  # req itself was preempted: the next running request is at i now
            out.add(req, n)
            budget -= n
            if not decoding and prompt_left is not None:
                prompt_left -= n
            i += 1
        budget += held
        if not out.preempted and self._delay_passed(now):
            room = budget if prompt_left is None else min(budget, max(prompt_left, self._head_floor()))
            self.admission.encoder.room = budget
            budget -= room - self.admission.admit(out, room, now)
        out.spare_tokens = budget
        self._use_leftover_budget(out, budget)
        return out

    def _prompt_cap(self, running: list[Request]) -> Optional[int]:
        """The pacer's cap on this step's prompt tokens (pacing.py), from its decode rows."""
        if self.pacer is None or not self.pacer.enabled:
            return None
        rows, kv, start, prompts = 0, 0, 0, bool(self.pool.waiting)  # start: the farthest chunk's (it attends to the most)
        for req in running:
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1:
                rows += 1
                kv += req.num_tokens  # the positions its row reads (batch_shape's count)
            elif remaining > 1:
                start, prompts = max(start, req.num_computed_tokens), True
        return self.pacer.prefill_cap(rows, start, kv) if prompts else None  # a decode-only step asks nothing

    def _head_floor(self) -> int:
        """A paced step's room for new prompts is never below one token while a head holds a
        reservation: backfill's promise (backfill.py) counts on the head starting once it fits."""
        return 1 if self.admission.reservation is not None else 0

    def _delay_passed(self, now: float) -> bool:
        """scheduler_delay_factor (vLLM's): while requests run, new prompts wait until the oldest
        waiting one has waited that factor times the last step, so that they start together."""
        factor = self.config.scheduler_delay_factor
        if factor <= 0 or not self.pool.running or not self.pool.waiting:
            return True
        earliest = min(r.arrival_time for r in self.pool.waiting)
        return now - earliest >= factor * self.last_step_seconds

    def _use_leftover_budget(self, out: SchedulerOutput, budget: int) -> None:
        """In-flight batching leaves it unused (padded batches spend it on padding rows)."""

    def _grow_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput) -> tuple[bool, int, int]:
        """Give req the blocks for num_tokens, preempting the least urgent running requests while
        they are short (max_utilization). Returns (req still runs, budget given back by victims
        already scheduled this step, how many of those were before req in the running list)."""
        if not self.blocks.extra_blocks_needed(req.seq_id, num_tokens):
            return True, 0, 0  # its last block has room (most decode steps)
        refund = earlier = 0
        running = self.pool.running
        while not self.blocks.can_grow(req.seq_id, num_tokens):
            if not self.policy.may_preempt:
                raise AssertionError(f"{self.policy.name}: {req.seq_id} ran out of reserved blocks")
            victim = self.pool.least_urgent()
            earlier += running.index(victim) < running.index(req)
            refund += self.pool.evict(victim, out)
            if victim is req:
                return False, refund, earlier
        self.blocks.grow(req.seq_id, num_tokens)
        return True, refund, earlier

    def plan(self, out: SchedulerOutput) -> StepPlan:
        """The step plan of a formed batch (drafts attached): what the worker runs. The sequences
        that left or were preempted since the last plan are named; a constrained row that samples
        gets its grammar bitmask (grammar.py); the KV tiers' copies ride along."""
        left, preempted = self.pool.take_changes()
        copies = self.tiers.take_plan() if self.tiers is not None else None
        return self.worker_view.plan(out, left, preempted, step_masks(out.seqs), copies)

    # -- speculative decoding (speculation.py): drafts get what the formed batch left ----------
    def draft_room(self, out: SchedulerOutput, rows: list[ScheduledSeq], k: int) -> dict[str, int]:
        return draft_room(out, self.blocks, rows, k, self.max_model_len)

    def attach_drafts(self, out: SchedulerOutput, room: Mapping[str, int], drafts: Mapping[str, tuple]) -> int:
        return attach_drafts(out, self.blocks, room, drafts)

    # -- after the model ran ------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: Mapping[str, object], now: float) -> list[Request]:
        """Record computed tokens and sampled ones (`sampled`: seq_id -> a step.Sampled); return the
        requests that finished this step. A verify row's tokens are taken one by one, each checked
        as if sampled alone: the first that ends the request ends it there."""
        finished = []
        for seq in out.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = seq.start + seq.num_new_tokens - len(seq.draft_token_ids)
            result = sampled.get(req.seq_id)
            status = None
            if result is not None and result.pooled is not None:  # a pooling request ends with its vector
                req.pooled, result, status = result.pooled, None, RequestStatus.FINISHED_STOPPED
            seq.taken = 0
            for i, token in enumerate(s.token for s in (result.tokens if result is not None else ())):
                req.num_computed_tokens += i > 0  # the token before it was an accepted draft: its KV is stored
                req.output_token_ids.append(token)
                seq.taken += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                # structured outputs: the grammar takes every token, and may end the request (a stop
                # or EOS token is still recorded as such by _stop_status, so its text is left out)
                ended = req.grammar.advance(req, token) if req.grammar is not None else None
                status = self._stop_status(req, token) or ended
                if status is not None:
                    break
            if self.blocks.enable_prefix_caching:  # only verified tokens: num_computed_tokens
                keyed = keyed_tokens(req.all_token_ids, req.mm_items) if req.mm_items else req  # images by hash
                self.blocks.register_computed(req.seq_id, keyed, req.num_computed_tokens, req.cache_salt)
            if status is not None:
                self.finish(req, status)
                finished.append(req)
                continue
            if seq.draft_token_ids:  # rejected drafts' slots: their blocks go back
                self.blocks.trim(req.seq_id, req.num_computed_tokens)
            self.blocks.slide(req.seq_id, req.num_computed_tokens)  # local layers: out of the window
            self.policy.refresh(req)
        self.gate.after_step(self.pool.running)
        return finished

    def _stop_status(self, req: Request, token: int) -> Optional[RequestStatus]:
        n_out = len(req.output_token_ids)
        if n_out >= req.params.min_tokens and (
                token in req.eos_token_ids or token in req.params.stop_token_ids):
            req.stop_token_id = token
            return RequestStatus.FINISHED_STOPPED
        if n_out >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.config.max_num_seqs)
        if self.tiers is not None:
            self.tiers.check_integrity()
