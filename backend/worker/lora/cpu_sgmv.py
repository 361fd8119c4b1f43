"""The CPU engine's segmented LoRA product, batched: every adapter's rows gathered into one
[slots, rows, features] block once per projection, one batched matmul for the shrink and one per
shard for the expand, added back in place. Same math as kernels/lora_reference.py (a loop over
segments), which stays the path where batching would waste more than it saves.

A step's `GatherPlan` is made once (backend/worker/lora/step.py) and serves every layer: which rows of
the flat batch belong to each slot (in slot order, padded to the longest), and where their
results go. The slots in the step are a range of the bank's (the ones between hold no row of the
step and are padding); padded positions compute on some row and are never added back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

MAX_WASTE = 2.0  # padded rows / real rows above which the loop over segments is cheaper


@dataclass
class GatherPlan:
    first_slot: int
    num_slots: int
    rows: int                         # rows per slot, padded (the longest slot's)
    gather: torch.Tensor              # [num_slots * rows] int64: the flat batch's row at each position
    targets: torch.Tensor             # [real rows] int64: where each real row's delta goes
    positions: Optional[torch.Tensor]  # [real rows] int64: their padded positions; None: all positions are real
    contiguous: Optional[tuple[int, int]]  # (first, end) when targets are exactly that range, in order


def gather_plan(runs: Sequence[tuple[int, int, int]], device: torch.device) -> Optional[GatherPlan]:
    """The plan for these segments (first row, end row, slot), or None where the loop over
    segments is cheaper (it runs then): one adapter in the step, or padding every slot to the
    longest costing more than MAX_WASTE x the real rows."""
    by_slot: dict[int, list[int]] = {}
    for start, end, slot in runs:
        by_slot.setdefault(slot, []).extend(range(start, end))
    if len(by_slot) < 2:
        return None
    first, last = min(by_slot), max(by_slot)
    num_slots = last - first + 1
    longest = max(len(rows) for rows in by_slot.values())
    real = sum(len(rows) for rows in by_slot.values())
    if num_slots * longest > MAX_WASTE * real:
        return None
    gather, targets, positions = [], [], []
    for s in range(first, last + 1):
        rows = by_slot.get(s, [])
        base = len(gather)
        gather += rows + [0] * (longest - len(rows))
        targets += rows
        positions += range(base, base + len(rows))
    padded = len(positions) != len(gather)
    contiguous = (targets[0], targets[-1] + 1) if targets == list(range(targets[0], targets[-1] + 1)) else None
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return GatherPlan(first, num_slots, longest, as_long(gather), as_long(targets),
                      as_long(positions) if padded else None, contiguous if not padded else None)


def lora_add_batched(out: torch.Tensor, x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
                     shard_bounds: Sequence[int], plan: GatherPlan) -> torch.Tensor:
    """out [T, N] += every segment's LoRA delta (see kernels/lora_reference.py), batched; returns out."""
    s0, slots, rows = plan.first_slot, plan.num_slots, plan.rows
    rank = b_bank.shape[2]
    xg = x.index_select(0, plan.gather).view(slots, rows, x.shape[1])
    y = torch.bmm(xg, a_bank[s0:s0 + slots].transpose(1, 2))                 # [slots, rows, shards * R]
    for i in range(len(shard_bounds) - 1):
        lo, hi = shard_bounds[i], shard_bounds[i + 1]
        delta = torch.bmm(y[:, :, i * rank:(i + 1) * rank], b_bank[s0:s0 + slots, lo:hi].transpose(1, 2))
        delta = delta.view(slots * rows, hi - lo)
        if plan.contiguous is not None:
            first, end = plan.contiguous
            out[first:end, lo:hi] += delta
            continue
        if plan.positions is not None:
            delta = delta.index_select(0, plan.positions)
        out[:, lo:hi].index_add_(0, plan.targets, delta)
    return out
