"""Where a model meets LoRA: `lora_project`, the one call the model makes per fused projection, and
`LoRADeltas`, what it asks of the step's adapters (the worker's LoRAStep, backend/worker/lora/step.py,
is one)."""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class LoRADeltas(Protocol):
    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """out (the projection's output for input x) += each adapter segment's delta; returns out."""


def lora_project(lora: Optional[LoRADeltas], layer: int, projection: str, module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` (a fused projection) with the step's adapter deltas added: the one call the model
    makes per projection (backend/models/llama.py). A row-parallel module (tensor parallelism,
    backend/models/parallel/layers.py) sums its ranks' partial outputs: the deltas are added to this rank's
    share before that sum, each from the rank's slice of x and of A (backend/models/parallel/plan.py)."""
    if lora is None:
        return module(x)
    reduce = getattr(module, "reduce", None)
    if reduce is not None:
        return reduce(lora.add(module.partial(x), x, layer, projection))
    return lora.add(module(x), x, layer, projection)
