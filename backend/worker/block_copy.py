"""Copy-on-write of KV blocks (beam search, backend/sched/beams.py): a beam that took another's
history got the other's partly filled last block copied into a block of its own; the plan names
the (source, destination) pairs and they are copied in every K and V tensor before the step runs.
A block id stands for the same rows of every tensor (backend/kv/groups.py), so each tensor is
copied once whatever layers share it."""
from __future__ import annotations

import torch


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
    """Copy block src to dst in every cache tensor; the pairs name distinct destinations that are
    no pair's source (fresh blocks), so the order does not matter."""
    if not copies:
        return
    dsts = [d for _, d in copies]
    if len(set(dsts)) != len(dsts) or set(dsts) & {s for s, _ in copies}:
        raise ValueError(f"block copies must write distinct fresh blocks; got {copies}")
    seen: set[int] = set()
    for pair in kv_caches:
        for cache in pair:
            if id(cache) in seen:
                continue
            seen.add(id(cache))
            src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=cache.device)
            cache.index_copy_(0, src.new_tensor(dsts), cache.index_select(0, src))


def copy_blocks_reference(kv_caches, copies) -> None:
    """The same, one block at a time (the tests' reference)."""
    for pair in kv_caches:
        for cache in pair:
            for s, d in copies:
                cache[d] = cache[s].clone()
