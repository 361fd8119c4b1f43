"""How evenly a mixture-of-experts model's router spreads the tokens: each expert's tokens per
layer, counted on the device (docs/design.md, "Mixture of experts")."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from backend.models.moe import SparseMoeBlock, moe_blocks


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer, counted on the device (no host read, so
    CUDA graphs capture it): `mark_rows` before a step says which rows are real (padding rows,
    slot -1, are not counted), each block's `record` adds its routing. `snapshot` reads the counts
    without waiting for the device (a copy started now, the last finished copy returned), and says
    how balanced the experts were since the snapshot before: the busiest expert's tokens over the
    mean, in the worst layer (1.0: even)."""

    def __init__(self, blocks: list[SparseMoeBlock], rows: int, device: torch.device):
        self.blocks = blocks
        experts = blocks[0].experts.num_experts
        self.counts = torch.zeros(len(blocks), experts, dtype=torch.int64, device=device)
        self.valid = torch.zeros(rows, dtype=torch.int64, device=device)
        self.copies: list[tuple[torch.Tensor, Optional[object]]] = []
        self.last = torch.zeros(len(blocks), experts, dtype=torch.int64)
        self.imbalance = 0.0
        for i, block in enumerate(blocks):
            block.load, block.load_row = self, i

    @classmethod
    def attach(cls, model: nn.Module, rows: int, device: torch.device) -> Optional["ExpertLoad"]:
        blocks = moe_blocks(model)
        return cls(blocks, rows, device) if blocks else None

    def mark_rows(self, slot_mapping: torch.Tensor) -> None:
        # a step past the token budget (a padded static batch) is not counted: the buffer a
        # captured graph reads must stay the same tensor, so it never grows
        self.skip = slot_mapping.shape[0] > self.valid.shape[0]
        if not self.skip:
            self.valid[:slot_mapping.shape[0]].copy_(slot_mapping >= 0)

    skip = False

    def record(self, row: int, ids: torch.Tensor) -> None:
        if self.skip:
            return
        t, k = ids.shape
        self.counts[row].scatter_add_(0, ids.reshape(-1).long(), self.valid[:t, None].expand(t, k).reshape(-1))

    def reset(self) -> None:
        """Forget what the warm-up and the graph capture routed."""
        self.counts.zero_()
        self.last.zero_()
        self.copies.clear()

    def snapshot(self) -> dict:
        """{"moe_expert_tokens": per expert, summed over layers, "moe_load_imbalance": ...}."""
        if self.counts.is_cuda:   # the copy finishes while the engine runs on; take the last one done
            host = torch.empty(self.counts.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(self.counts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.copies.append((host, event))
            done = [i for i, (_, e) in enumerate(self.copies) if e.query()]
            current = self.copies[done[-1]][0].clone() if done else self.last
            del self.copies[:done[-1] + 1 if done else 0]
        else:
            current = self.counts.clone()
        delta = (current - self.last).float()
        mean = delta.mean(dim=1)
        if float(mean.max()) > 0:
            self.imbalance = float((delta.max(dim=1).values / mean.clamp(min=1e-9))[mean > 0].max())
        self.last = current
        return {"moe_expert_tokens": current.sum(dim=0).tolist(), "moe_load_imbalance": self.imbalance}
