"""Capacity policies: who may hold KV blocks. Batch forming (who computes how many tokens this step)
lives in the scheduler; these classes only answer "may this request start?" and "how do we make
room?". One small class per policy behind one interface, after TensorRT-LLM's
GuaranteedNoEvictScheduler and MaxUtilizationScheduler. No torch here.
"""
from __future__ import annotations

from typing import Sequence

from backend.block_manager import BlockManager
from backend.request import Request


class CapacityPolicy:
    name = ""
    may_preempt = False

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks

    def can_admit(self, request: Request, running: Sequence[Request], tokens_now: int) -> bool:
        raise NotImplementedError

    def reserved_blocks(self, running: Sequence[Request]) -> int:
        """Blocks `running` holds (a shared block once), and, for policies that promise them, the
        blocks they may still need."""
        return len({b for r in running for b in self.blocks.block_table(r.seq_id)})

    def check_invariant(self, running: Sequence[Request]) -> None:
        """Raise AssertionError when the policy's promise does not hold for `running`."""


class GuaranteedNoEvict(CapacityPolicy):
    """Start a request only when the blocks to finish it, and those every running request may still
    need, fit in the cache together. A started request therefore never waits for blocks.

    Prefix-aware: a block shared through the prefix cache (or forked among the n completions of
    one prompt) is reserved once, however many hold it; cached blocks nobody holds count as free."""
    name = "guaranteed_no_evict"

    def reserved_blocks(self, running: Sequence[Request]) -> int:
        future = sum(max(0, self.blocks.blocks_for(r.max_kv_tokens) - self.blocks.num_blocks_of(r.seq_id))
                     for r in running)
        return super().reserved_blocks(running) + future

    def can_admit(self, request: Request, running: Sequence[Request], tokens_now: int) -> bool:
        return self.reserved_blocks([*running, request]) <= self.blocks.num_blocks

    def check_invariant(self, running: Sequence[Request]) -> None:
        reserved = self.reserved_blocks(running)
        assert reserved <= self.blocks.num_blocks, (
            f"no-evict reservation broken: running requests may need {reserved} blocks "
            f"of {self.blocks.num_blocks}")
        for r in running:
            assert self.blocks.num_blocks_of(r.seq_id) <= self.blocks.blocks_for(r.max_kv_tokens)


class MaxUtilization(CapacityPolicy):
    """Start a request when this step's blocks fit; when blocks run out later, the scheduler
    preempts the newest running request and recomputes it from its tokens."""
    name = "max_utilization"
    may_preempt = True

    def can_admit(self, request: Request, running: Sequence[Request], tokens_now: int) -> bool:
        return self.blocks.can_grow(request.seq_id, tokens_now)


POLICIES = {p.name: p for p in (GuaranteedNoEvict, MaxUtilization)}


def make_policy(name: str, blocks: BlockManager) -> CapacityPolicy:
    return POLICIES[name](blocks)
