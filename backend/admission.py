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
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from backend.backfill import Backfill, Window
from backend.request import Request

if TYPE_CHECKING:
    from backend.scheduler import SchedulerOutput


class Admission:
    """Mixed into Scheduler, which provides waiting, running, blocks, policy, gate and config."""

    def _init_admission(self) -> None:
        self.num_backfilled = 0  # requests started ahead of a head that did not fit
        self.steps = 0  # schedule() calls: the clock of reservations
        # The head's reservation: (seq_id, the step by which it surely starts), kept at its earliest.
        self.reservation: Optional[tuple[str, int]] = None
        self.backfill: Optional[Backfill] = None
        c = self.config
        if (c.enable_backfill and c.batch_scheduler_policy == "guaranteed_no_evict" and c.batching_mode == "inflight"
                and Backfill.usable(c.enable_chunked_context, c.max_num_batched_tokens, c.max_num_seqs)):
            self.backfill = Backfill(self.blocks.num_blocks, c.max_num_seqs, self.blocks.blocks_for,
                                     self.policy.reserved_blocks)

    def _least_urgent(self) -> Request:
        """The running request to preempt: the least urgent, the newest among equals (vLLM)."""
        return max(reversed(self.running), key=lambda r: r.priority)

    def _admit(self, out: "SchedulerOutput", budget: int, now: float) -> int:
        allowed = self.gate.num_to_admit(self.waiting, self.holders(), now)
        window: Optional[Window] = None  # set once a head does not fit (backfill only)
        queue, i = list(self.waiting), 0
        while i < len(queue):
            req = queue[i]
            i += 1
            if not (allowed > 0 and budget > 0 and len(self.running) < self.config.max_num_seqs):
                break
            if self._waits_for_sibling(req):
                break
            req.num_computed_tokens = self._reuse_computed(req)
            n = self._chunk(req, budget)
            fits = n > 0 and self.policy.can_admit(req, self.running, req.num_computed_tokens + n)
            if fits and window is not None:
                # no sharing credit: the blocks it shares now may be its alone by the reservation
                fits = window.admits(req, self.blocks.blocks_for(req.max_kv_tokens))
            if not fits and self.policy.may_preempt:
                freed = self._preempt_for(req, out)
                if freed is not None:
                    budget += freed
                    i -= 1  # try req again, with the victim's blocks free
                    continue
            if not fits:
                self.blocks.free(req.seq_id)  # give back a reused prefix; it stays cached
                req.num_computed_tokens = 0
                if window is None:
                    window = self._window(req)
                    if window is None:
                        break  # strict order: no skipping past a request that does not fit
                continue
            self._start(req, req.num_computed_tokens + n, now)
            self.prefix_hit_tokens += req.num_computed_tokens
            self.num_backfilled += window is not None
            self._add(out, req, n)
            budget -= n
            allowed -= 1
        if self.reservation is not None and self.reservation[0] not in self._waiting_ids():
            self.reservation = None  # its head started (or was aborted); a loop cut short keeps it
        return budget

    def _waiting_ids(self) -> set[str]:
        return {r.seq_id for r in self.waiting}

    def _window(self, head: Request) -> Optional[Window]:
        """The head's backfill window (None when backfill is off), and its reservation kept."""
        if self.backfill is None:
            return None
        window = self.backfill.window(head, self.running)
        if window is not None:
            at = self.steps + window.reserve_by - 1  # reserve_by 1 is this schedule() call
            if self.reservation is None or self.reservation[0] != head.seq_id or at < self.reservation[1]:
                self.reservation = (head.seq_id, at)
                self.reservation_priority = head.priority
        return window

    def _preempt_for(self, req: Request, out: "SchedulerOutput") -> Optional[int]:
        """max_utilization with priorities: preempt the least urgent running request when it is
        less urgent than req (vLLM's priority policy). Returns the budget its rows gave back."""
        if not self.running:
            return None
        victim = self._least_urgent()
        if victim.priority <= req.priority:
            return None
        self.blocks.free(req.seq_id)
        req.num_computed_tokens = 0
        return self._evict(victim, out)

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

