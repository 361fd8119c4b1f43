"""Admission: which waiting requests start this step (the scheduler's second half). No torch here.

Waiting requests are tried most urgent first (priority, then arrival) while the batching gate,
`max_num_seqs`, the token budget and the capacity policy (policies.py) let them start:
- `guaranteed_no_evict`, strict (`enable_backfill` false, as TensorRT-LLM): stop at the first
  request that does not fit, the head;
- with `enable_backfill` (the default): later requests may start when they cannot delay the head
  past its reservation (backfill.py);
- `max_utilization`: a request that does not fit may preempt the least urgent running request
  when it is less urgent (vLLM's priority policy).
The n completions of one prompt start after the first has computed it, sharing its blocks.

`Admission` is a collaborator of the scheduler: it works on the `RequestPool` and the batching
gate it is given, and keeps the reservation clock (`steps`) and the head's reservation.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from backend.kv.block_manager import block_hashes
from backend.core.config import EngineConfig
from backend.core.multimodal import EncoderBudget, image_chunk, keyed_tokens
from backend.core.request import Request
from backend.sched.backfill import Backfill, Window
from backend.sched.batching import BatchingGate
from backend.sched.lora_slots import LoRASlots
from backend.sched.pool import RequestPool
from backend.sched.siblings import family_size, first_sibling, start_family, waits_for_sibling
from backend.sched.batch import SchedulerOutput
from backend.sched.step_cost import StepCost
from backend.sched.tier_admission import TierAdmission


class Reservation(NamedTuple):
    seq_id: str  # the head
    step: int  # the schedule() call by which it surely starts


def chunk(req: Request, budget: int, config: EngineConfig, encoder: Optional[EncoderBudget] = None) -> int:
    """How many of req's uncomputed tokens this step may take (a chunk never ends inside an image,
    and takes no more image tokens than the step's `encoder` budget has left: core/multimodal.py)."""
    remaining = req.num_tokens - req.num_computed_tokens
    chunked = config.enable_chunked_context or remaining > config.max_num_batched_tokens
    n = max(0, remaining if remaining <= budget else budget if chunked else 0)  # (a paced image may overdraw)
    return image_chunk(req.mm_items, req.num_computed_tokens, n, encoder) if req.mm_items else n


class Admission:
    def __init__(self, config: EngineConfig, pool: RequestPool, gate: BatchingGate, tiers=None,
                 cost: Optional[StepCost] = None):
        self.config = config
        self.pool = pool
        self.blocks = pool.blocks
        self.policy = pool.policy
        self.gate = gate
        self.num_backfilled = 0  # requests started ahead of a head that did not fit
        self.prefix_hit_tokens = 0  # prompt tokens whose KV was reused instead of computed
        self.steps = 0  # schedule() calls: the clock of reservations
        self.reservation: Optional[Reservation] = None  # the head's, kept at its earliest
        self._reserved_priority = 0
        self.backfill: Optional[Backfill] = None
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None  # lora_slots.py
        self.encoder = EncoderBudget(config)  # the step's image tokens to encode (reset by schedule())
        # The KV tiers (backend/kv/tiers/manager.KVTiers) when they are on: a prefix found there comes
        # back into the request's blocks before it runs a row (tier_admission.py).
        self.tiers = None if tiers is None else TierAdmission(config.kv_tier_load_policy, pool, tiers, cost,
                                                               self._prefix_hashes)
        c = config
        if (c.enable_backfill and c.batch_scheduler_policy == "guaranteed_no_evict" and c.batching_mode == "inflight"
                and Backfill.usable(c.enable_chunked_context, c.max_num_batched_tokens, c.max_num_seqs)):
            self.backfill = Backfill(self.blocks, c.max_num_seqs, self.policy)

    def arrived(self, req: Request) -> None:
        """A more urgent request runs first, even on blocks the head was promised: the head's
        reservation is void and computed again at the next step (docs/design.md, "Priority")."""
        if self.reservation is not None and req.priority < self._reserved_priority:
            self.reservation = None

    def held_token(self) -> int:
        """1 on and after the head's reserved step: a token of the budget kept for it, so that
        running prefills cannot crowd it out (backfill.py counts on a budget above max_num_seqs)."""
        return 1 if self.reservation is not None and self.reservation.step <= self.steps else 0

    def admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Start waiting requests into `out` within `budget`; returns the budget left."""
        pool, config = self.pool, self.config
        allowed = self.gate.num_to_admit(pool.waiting, pool.holders(), now)
        window: Optional[Window] = None  # set once a head does not fit (backfill only)
        unstarted: set[str] = set()  # requests whose first completion was passed over in this pass
        queue, i = list(pool.waiting), 0
        if self.lora_slots is not None:
            self.lora_slots.begin(pool.running)
        if self.tiers is not None:
            self.tiers.begin()
        while i < len(queue):
            req = queue[i]
            i += 1
            if req.parked:
                continue  # a beam that started with its family in this pass
            if not (allowed > 0 and budget > 0 and len(pool.running) < config.max_num_seqs):
                break
            if req.index and waits_for_sibling(self.pool.running, req, unstarted):
                break
            if self.lora_slots is not None and not self.lora_slots.may_start(req):
                if req.index == 0:
                    unstarted.add(req.request_id)
                continue  # waits for a LoRA slot, keeping its place (lora_slots.py)
            if self._cannot_fit_untried(req):  # the common case under overload: nothing attached
                n, lower, fits = 0, 0, False
            else:
                req.num_computed_tokens = self._reuse_computed(req)
                lower = self.tiers.lower_blocks(req) if self.tiers is not None else 0  # > 0: runs once back
                n = 0 if lower else chunk(req, budget, config, self.encoder)
                held = req.num_computed_tokens + (lower * self.blocks.block_size if lower else n)
                fits = ((n > 0 or lower > 0) and len(pool.running) + family_size(req) <= config.max_num_seqs
                        and self.policy.can_admit(req, held))
            if fits and window is not None:
                # no sharing credit: the blocks it shares now may be its alone by the reservation;
                # a beam search is never started ahead of the head (its family would need more slots)
                fits = family_size(req) == 1 and window.admits(req, self.blocks.blocks_for(req.max_kv_tokens))
            if not fits and self.policy.may_preempt:
                freed = self._preempt_for(req, out, unstarted)
                if freed is not None:
                    budget += freed
                    i -= 1  # try req again, with the victim's blocks free
                    continue
            if not fits:
                if req.index == 0:
                    unstarted.add(req.request_id)
                if req.num_computed_tokens:
                    self.blocks.free(req.seq_id)  # give back a reused prefix; it stays cached
                    req.num_computed_tokens = 0
                if window is None:
                    window = self._window(req)
                    if window is None:
                        break  # strict order: no skipping past a request that does not fit
                continue
            if self.tiers is not None and req.index == 0:
                self.tiers.start(req, lower, n, now, self.steps)
            else:
                pool.start(req, req.num_computed_tokens + n, now, self.steps)
            if family_size(req) > 1:
                start_family(pool, req, queue[i:], now, self.steps)
            if self.lora_slots is not None:
                self.lora_slots.started(req)
            self.prefix_hit_tokens += req.num_computed_tokens
            if req.index == 0 and not req.num_preemptions:
                req.num_cached_tokens = req.num_computed_tokens  # prompt tokens served from a cache
            self.num_backfilled += window is not None
            if not lower:
                out.add(req, n)
                budget -= n
            allowed -= 1
        if self.reservation is not None and self.reservation.seq_id not in {r.seq_id for r in pool.waiting}:
            self.reservation = None  # its head started (or was aborted); a loop cut short keeps it
        return budget

    def _window(self, head: Request) -> Optional[Window]:
        """The head's backfill window (None when backfill is off), and its reservation kept."""
        if self.backfill is None:
            return None
        window = self.backfill.window(head, self.pool.running)
        if window is not None:
            at = self.steps + window.reserve_by - 1  # reserve_by 1 is this schedule() call
            r = self.reservation
            if r is None or r.seq_id != head.seq_id or at < r.step:
                self.reservation = Reservation(head.seq_id, at)
                self._reserved_priority = head.priority
        return window

    def _preempt_for(self, req: Request, out: SchedulerOutput, unstarted: set[str]) -> Optional[int]:
        """max_utilization with priorities: preempt the least urgent running request when it is
        less urgent than req (vLLM's priority policy). Returns the budget its rows gave back."""
        if not self.pool.running:
            return None
        victim = self.pool.least_urgent()
        if victim.priority <= req.priority:
            return None
        self.blocks.free(req.seq_id)
        req.num_computed_tokens = 0
        if victim.index == 0:
            unstarted.add(victim.request_id)  # it waits again: its later completions wait for it
        return self.pool.evict(victim, out)

    # -- n > 1: the completions of one prompt share its KV (siblings.py) -----------------------
    def ready(self, req: Request) -> bool:
        """May a running request run a row this step? Not while its prefix comes back from a
        lower tier (`landed`), nor while it is a parked beam whose first has not computed the
        prompt: then it forks the prompt's full blocks and computes the rest."""
        if req.kv_load is not None:
            return self.landed(req)
        if req.parked:
            if waits_for_sibling(self.pool.running, req, set()):
                return False
            req.parked = False
            req.num_computed_tokens = self._reuse_computed(req)
            self.prefix_hit_tokens += req.num_computed_tokens
            self.policy.refresh(req)  # its need now counts the blocks it shares, as it holds them
        return True

    def _reuse_computed(self, req: Request) -> int:
        """Tokens already in the cache for req: its first sibling's full prompt blocks, shared, or
        a cached prefix (enable_kv_cache_reuse). The last prompt token is always computed again, so
        that its logits give the first token."""
        first = first_sibling(self.pool.running, req)
        if first is not None:
            forked = self.blocks.fork(first.seq_id, req.seq_id, req.num_prompt_tokens - 1)
            if forked or not self.blocks.enable_prefix_caching:
                return forked  # (a local group that gave back the prompt's window shares nothing)
        if not self.blocks.enable_prefix_caching or req.computes_whole_prompt:
            return 0  # (vLLM: a request for prompt logprobs computes its whole prompt; mean pooling too)
        return self.blocks.reuse_prefix(req.seq_id, hashes=self._prefix_hashes(req))

    def _prefix_hashes(self, req: Request) -> list[bytes]:
        """req's prefix-cache keys, computed once while it waits rather than at every step."""
        if req.prefix_hashes is None or req.prefix_hashes[0] != req.num_tokens:
            tokens = keyed_tokens(req.all_token_ids, req.mm_items) if req.mm_items else req.all_token_ids
            req.prefix_hashes = (len(tokens), block_hashes(tokens, self.blocks.block_size, len(tokens) - 1,
                                                           root=req.cache_salt))
        return req.prefix_hashes[1]

    def landed(self, req: Request) -> bool:
        """Has req's prefix come back from the lower tiers? Then its blocks that arrived (all, or
        those before a file that failed its checks) are computed tokens from now on."""
        if not req.kv_load.done:
            return False
        tokens = self.tiers.arrived(req)
        if tokens is None:  # a grouped load failed: the request computes from its device prefix again
            self.blocks.free(req.seq_id)
            req.num_computed_tokens = self._reuse_computed(req)
            self.policy.refresh(req)
            return True
        req.num_computed_tokens += tokens
        self.prefix_hit_tokens += tokens
        if not req.num_preemptions:
            req.num_cached_tokens += tokens
        return True

    def _cannot_fit_untried(self, req: Request) -> bool:
        """True when req surely cannot start now, known without attaching its cached prefix: the
        blocks it would share with running requests are counted, not attached. When its prefix
        reaches a cached block nobody holds, it is tried for real (attaching and giving back such
        blocks refreshes them in the cache's eviction order, which this must not change)."""
        if req.index:
            return False  # a later completion shares its first one's prompt: tried for real
        shared = 0
        if self.blocks.enable_prefix_caching:
            shared, touches_free = self.blocks.probe_prefix(self._prefix_hashes(req))
            if touches_free:
                return False
        return self.policy.cannot_fit(req, shared)
