"""Backfilled admission under `guaranteed_no_evict` (EASY backfilling, as HPC batch schedulers do).

Strict no-evict admission stops at the first waiting request that does not fit: one request with a
large `max_tokens` at the head blocks every small one behind it, while blocks sit unreserved. But
under no-evict every running request's worst-case finish is known, so the step by which the head
surely fits (its *reservation*) and what is spare at that step can be computed. A later request may
start now if it fits today and either finishes, at worst, before the reservation, or fits in what
is spare then. Nothing is evicted and the head never starts later than its reservation.

Worst-case finish, in steps from now (this step is step 1): a running request r finishes after at
most `own(r) + excess(older than r)` steps, where `own` is the tokens it still computes plus the
tokens it may still sample, less one, and `excess` is the prompt tokens still to compute by the
requests served before it beyond one per step. Each step either serves r (its own work drops by at
least one) or spends the whole token budget on older requests, which, while the budget exceeds
`max_num_seqs`, uses up at least one token of their excess. Requests admitted later are served after
r, so they never delay it. This needs chunked prefill and a budget above `max_num_seqs`
(`Backfill.usable`); otherwise admission stays strict. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from backend.kv.groups import KVCacheGroups
from backend.core.request import Request
from backend.sched.policies import GuaranteedNoEvict
from backend.sched.siblings import family_size


def own_work(req: Request) -> int:
    """Steps req needs when it is served at every step: the tokens it still computes, plus the
    tokens it may still sample, less the one sampled by the step that computes its last token."""
    uncomputed = req.num_tokens - req.num_computed_tokens
    return uncomputed + (req.params.max_tokens - len(req.output_token_ids)) - 1


def excess(req: Request) -> int:
    """Prompt tokens req still computes beyond one per step."""
    return max(0, req.num_tokens - req.num_computed_tokens - 1)


def finish_bounds(running: Sequence[Request]) -> list[int]:
    """Worst-case finish step of each running request (in service order: oldest first)."""
    bounds, ahead = [], 0
    for r in running:
        bounds.append(ahead + own_work(r))
        ahead += excess(r)
    return bounds


@dataclass
class Window:
    """What may start ahead of the head now, without delaying it past its reservation."""
    head: Request
    reserve_by: int  # the head surely fits at this step (1 = this one)
    spare_blocks: int  # blocks free at reserve_by beyond the head's
    spare_slots: int  # running slots free at reserve_by beyond the head's
    ahead: int  # excess of everything running: a newly started request is served after it all

    def admits(self, req: Request, need: int) -> bool:
        """req fits now (checked by the caller); it may start if it finishes before the head's
        reservation or fits in what is spare then. Spends the spare when it does."""
        if self.ahead + own_work(req) < self.reserve_by:
            self.ahead += excess(req)
            return True
        if need <= self.spare_blocks and self.spare_slots >= 1:
            self.spare_blocks -= need
            self.spare_slots -= 1
            self.ahead += excess(req)
            return True
        return False


class Backfill:
    def __init__(self, blocks: KVCacheGroups, max_num_seqs: int, policy: GuaranteedNoEvict):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.policy = policy

    @staticmethod
    def usable(chunked: bool, budget: int, max_num_seqs: int) -> bool:
        return chunked and budget > max_num_seqs

    def window(self, head: Request, running: Sequence[Request]) -> Optional[Window]:
        """The head's reservation and what is spare then; None if it can never fit (a request
        that does not fit even alone is refused at arrival, so this is defensive).

        Walks the running requests in order of their worst-case finish, taking each one's blocks
        out of the reservation as it ends: O(their blocks) in all, from the policy's tally (which
        counts every holder: `running` is all of them under in-flight batching)."""
        bounds = finish_bounds(running)
        need = self.blocks.blocks_for(head.max_kv_tokens)  # no prefix credit: its cached blocks may be gone by then
        need += self.policy.family_blocks(head)  # a beam search starts with all its beams (siblings.py)
        family = family_size(head)
        ending = sorted(range(len(running)), key=bounds.__getitem__)
        reserved, still = self.policy.reserved_blocks(), len(running)
        dropped: dict[int, int] = {}  # block -> holders already ended
        ahead = sum(excess(r) for r in running)
        j = 0
        for at in sorted({1} | {b + 1 for b in bounds}):
            while j < len(ending) and bounds[ending[j]] < at:  # finished by step `at`: its blocks are free
                r = running[ending[j]]
                held = self.blocks.held_blocks(r.seq_id)
                reserved -= self.policy.reserved_for(r) - len(held)
                for b in held:
                    dropped[b] = dropped.get(b, 0) + 1
                    reserved -= dropped[b] == self.blocks.ref_count(b)
                still -= 1
                j += 1
            free = self.blocks.num_blocks - reserved
            slots = self.max_num_seqs - still
            if free >= need and slots >= family:
                return Window(head, at, free - need, slots - family, ahead)
        return None
