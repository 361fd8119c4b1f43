"""Capacity policies: who may hold KV blocks. Batch forming (who computes how many tokens this step)
lives in the scheduler; these classes only answer "may this request start?" and "how do we make
room?". One small class per policy behind one interface, after TensorRT-LLM's
GuaranteedNoEvictScheduler and MaxUtilizationScheduler. No torch here.

Each policy keeps its reservation as a running tally, told by the pool when a request starts
holding blocks and when it gives them back, so that trying a waiting request costs O(1) however
many requests run, and `reserved_blocks()` (the metrics' `kv_blocks{state="reserved"}`) is a read.
`check_invariant` recomputes it from the block tables.
"""
from __future__ import annotations

from typing import Sequence

from backend.kv.groups import KVCacheGroups
from backend.core.request import Request


class CapacityPolicy:
    name = ""
    may_preempt = False

    def __init__(self, blocks: KVCacheGroups):
        self.blocks = blocks

    def started(self, request: Request) -> None:
        """request now holds blocks (it started running)."""

    def released(self, request: Request) -> None:
        """request holds no blocks any more (it finished or was preempted)."""

    def refresh(self, request: Request) -> None:
        """request ran a step (its tables slid): what it may still need can have fallen."""

    def can_admit(self, request: Request, tokens_now: int) -> bool:
        """May request (holding what it reuses, if anything) start, computing tokens_now tokens?"""
        raise NotImplementedError

    def cannot_fit(self, request: Request, shared: int) -> bool:
        """True when request, sharing `shared` blocks that running requests hold, surely cannot
        start now: checked before anything is attached, so a waiting request that does not fit
        costs O(its shared blocks) a step."""
        return False

    def reserved_for(self, request: Request) -> int:
        """The blocks a running request has reserved: what it holds (no-evict: to completion)."""
        return self.blocks.num_blocks_of(request.seq_id)

    def reserved_blocks(self) -> int:
        """Blocks the holders hold (a shared block once), and, for policies that promise them, the
        blocks they may still need. Valid between admissions (only holders hold blocks)."""
        return self.blocks.num_used_blocks

    def reserved_by(self, holders: Sequence[Request]) -> int:
        """The same, recomputed from the block tables of `holders` (the check of the tally)."""
        return len({b for r in holders for b in self.blocks.held_blocks(r.seq_id)})

    def check_invariant(self, holders: Sequence[Request]) -> None:
        """Raise AssertionError when the policy's promise, or its tally, does not hold."""
        recomputed = self.reserved_by(holders)
        assert self.reserved_blocks() == recomputed, f"reserved tally {self.reserved_blocks()}, tables say {recomputed}"


class GuaranteedNoEvict(CapacityPolicy):
    """Start a request only when the blocks to finish it, and those every running request may still
    need, fit in the cache together. A started request therefore never waits for blocks.

    Prefix-aware: a block shared through the prefix cache (or forked among the n completions of
    one prompt) is reserved once, however many hold it; cached blocks nobody holds count as free.

    The tally: with H the holders, reserved = |blocks held| + sum over H of (need(r) - held by r),
    where need(r) is the most blocks r holds at once from now to completion. |blocks held| is the
    block manager's used count and the sum of held-by-r is its `num_held`, so only sum(need) is
    kept here. A candidate that holds a reused prefix while it is tried is counted by the same two
    numbers: its cost is need(c).

    What a request holds at once is all its blocks for a model whose layers all attend globally;
    a local (sliding-window) layer's group holds only the window and a step's tokens
    (backend/kv/groups.py), fewer once the prompt is computed and steps are decode steps: need(r)
    is kept per request and falls then (`refresh`), freeing reservation for others."""
    name = "guaranteed_no_evict"

    def __init__(self, blocks: KVCacheGroups):
        super().__init__(blocks)
        self.need_total = 0  # sum of need() over the holders
        self._needs: dict[str, int] = {}  # each holder's need, as counted in need_total
        self._decoding: set[str] = set()  # holders past their prompt: their need no longer changes

    def need(self, request: Request) -> int:
        """The most blocks request holds at once from now on; a parked beam's, less the prompt's
        full blocks it will fork from its first (counted once, by the first)."""
        decoding = request.num_tokens - request.num_computed_tokens <= 1  # a decode step next
        need = self.blocks.blocks_for(request.max_kv_tokens, decoding)
        return need - self._prompt_shared(request) if request.parked else need

    def reserved_for(self, request: Request) -> int:
        return self._needs.get(request.seq_id, self.need(request))

    def started(self, request: Request) -> None:
        self._needs[request.seq_id] = self.need(request)
        self.need_total += self._needs[request.seq_id]

    def released(self, request: Request) -> None:
        self.need_total -= self._needs.pop(request.seq_id)
        self._decoding.discard(request.seq_id)

    def refresh(self, request: Request) -> None:
        old = self._needs.get(request.seq_id)
        if old is not None and request.seq_id not in self._decoding:  # a decoding request's need stays
            self._needs[request.seq_id] = self.need(request)
            self.need_total += self._needs[request.seq_id] - old
            if request.num_tokens - request.num_computed_tokens <= 1:
                self._decoding.add(request.seq_id)

    def reserved_blocks(self) -> int:
        return self.blocks.num_used_blocks + self.need_total - self.blocks.num_held

    def cannot_fit(self, request: Request, shared: int) -> bool:
        return self.reserved_blocks() + self.need(request) + self.family_blocks(request) - shared > self.blocks.num_blocks

    def can_admit(self, request: Request, tokens_now: int) -> bool:
        return self.reserved_blocks() + self.need(request) + self.family_blocks(request) <= self.blocks.num_blocks

    def family_blocks(self, request: Request) -> int:
        """Beam search (backend/sched/beams.py): the blocks a search's later beams add to its first's
        (each its own growth beside the prompt's full blocks they share). A search waits for all its
        beams, so its family starts as one, in the step its first does (admission.py), or not at all:
        one that started without room for them would hold its blocks and wait forever."""
        if request.index or not request.params.use_beam_search:
            return 0
        return (request.params.n - 1) * (self.need(request) - self._prompt_shared(request))

    def _prompt_shared(self, request: Request) -> int:
        """The prompt's full blocks a later completion forks (with local layers: none counted)."""
        return (request.num_prompt_tokens - 1) // self.blocks.block_size if len(self.blocks.groups) == 1 else 0

    def reserved_by(self, holders: Sequence[Request]) -> int:
        future = sum(max(0, self.reserved_for(r) - self.blocks.num_blocks_of(r.seq_id)) for r in holders)
        return super().reserved_by(holders) + future

    def check_invariant(self, holders: Sequence[Request]) -> None:
        super().check_invariant(holders)
        reserved = self.reserved_blocks()
        assert reserved <= self.blocks.num_blocks, (
            f"no-evict reservation broken: running requests may need {reserved} blocks "
            f"of {self.blocks.num_blocks}")
        assert set(self._needs) == {r.seq_id for r in holders}, "the needs kept are not the holders'"
        for r in holders:
            assert self.blocks.num_blocks_of(r.seq_id) <= self.reserved_for(r), (
                f"{r.seq_id} holds {self.blocks.num_blocks_of(r.seq_id)} blocks, needs {self.reserved_for(r)}")


class MaxUtilization(CapacityPolicy):
    """Start a request when this step's blocks fit; when blocks run out later, the scheduler
    preempts the newest running request and recomputes it from its tokens."""
    name = "max_utilization"
    may_preempt = True

    def can_admit(self, request: Request, tokens_now: int) -> bool:
        return self.blocks.can_grow(request.seq_id, tokens_now)


POLICIES = {p.name: p for p in (GuaranteedNoEvict, MaxUtilization)}


def make_policy(name: str, blocks: KVCacheGroups) -> CapacityPolicy:
    return POLICIES[name](blocks)
