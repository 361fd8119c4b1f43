"""The per-step LoRA object every layer reads (`AttentionContext.lora`, through
backend/models/lora/project.py's `lora_project`): after a fused projection's GEMM,
`add(out, x, layer, projection)` adds the low-rank product of each adapter segment of the step to
that projection's output, in place.

The segments come from the step's rows grouped by adapter (backend/worker/lora/segments.py), made once
per step and kept per fused projection (an adapter that does not touch a projection is left out
of its segments). On CUDA the segmented Triton kernels run (kernels/gpu/lora_sgmv.py: one shrink and
one expand launch per projection, whatever the mix); elsewhere the batched CPU path
(cpu_sgmv.py: the step's rows gathered per slot, batched matmuls), or the torch reference's loop
over segments on row slices (kernels/lora_reference.py) where padding the slots would waste more.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from backend.worker.device import to_device
from backend.worker.lora.bank import LoRABank
from backend.worker.lora.cpu_sgmv import GatherPlan, gather_plan, lora_add_batched
from backend.models.lora.peft_format import FUSED
from kernels.lora_reference import Segments


class LoRAStep:
    def __init__(self, bank: LoRABank, runs: list[tuple[int, int, int]], num_rows: int,
                 lora_add: Callable, on_device: bool, every_projection: bool = False):
        """`runs`: (first row, end row, slot) of the step's adapter segments; `lora_add`: the
        segmented product (kernel or reference); `on_device`: give the kernels the segments as
        device tensors (one transfer for the step); `every_projection`: keep a run in a projection
        its adapter does not touch (the warm-up)."""
        self.bank = bank
        self.lora_add = lora_add
        self.segments: dict[str, Segments] = {
            fused: Segments([r for r in runs if every_projection or fused in bank.targets[r[2]]]) for fused in FUSED}
        self.plans: dict[str, Optional[GatherPlan]] = {}
        if on_device:
            self._to_device(num_rows)
        else:  # the batched CPU path where it pays (cpu_sgmv.py), made once for every layer
            device = next(iter(bank.a.values())).device
            made: dict[tuple, Optional[GatherPlan]] = {}
            for fused, seg in self.segments.items():
                key = tuple(seg.runs)
                if key not in made:
                    made[key] = gather_plan(seg.runs, device)
                self.plans[fused] = made[key]

    @classmethod
    def warm_up(cls, bank: LoRABank, lora_add: Callable) -> None:
        """Launch each projection's kernels once on a one-row step of slot 0, so the variants
        serving launches are compiled at start, not by the first LoRA request (the segments'
        count and lengths are runtime values: one variant serves every step)."""
        step = cls(bank, [(0, 1, 0)], 1, lora_add, on_device=True, every_projection=True)
        for fused in FUSED:
            a = bank.a[(0, fused)]
            x = torch.zeros((1, a.shape[2]), dtype=a.dtype, device=a.device)
            step.add(torch.zeros((1, bank.shard_bounds[fused][-1]), dtype=a.dtype, device=a.device), x, 0, fused)

    def _to_device(self, num_rows: int) -> None:
        """Each projection's segments as int32 device tensors (starts, lens, slots), padded to the
        same count with slot -1, in one host-to-device copy."""
        # a multiple of 4 int32s: every table starts 16-byte aligned, as the compiled variants expect
        width = -(-max(1, max(len(s.runs) for s in self.segments.values())) // 4) * 4
        host = np.zeros((len(self.segments), 3, width), dtype=np.int32)
        host[:, 2] = -1
        for i, seg in enumerate(self.segments.values()):
            for j, (start, end, slot) in enumerate(seg.runs):
                host[i, :, j] = (start, end - start, slot)
        table = to_device(host, next(iter(self.bank.a.values())).device)
        for i, seg in enumerate(self.segments.values()):
            seg.starts, seg.lens, seg.slots = table[i, 0], table[i, 1], table[i, 2]
            seg.max_len = max((end - start for start, end, _ in seg.runs), default=0) or num_rows

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """out (the projection's output for input x) += each segment's adapter delta; returns out."""
        segments = self.segments[projection]
        if not segments.runs:
            return out
        key = (layer, projection)
        plan = self.plans.get(projection)
        if plan is not None:
            return lora_add_batched(out, x, self.bank.a[key], self.bank.b[key], self.bank.shard_bounds[projection], plan)
        return self.lora_add(out, x, self.bank.a[key], self.bank.b[key], self.bank.shard_bounds[projection], segments)
