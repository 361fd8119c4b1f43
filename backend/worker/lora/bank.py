"""The resident adapters' weights on the device: `max_loras` slots, stacked per layer and fused
projection, so one step reads any mix of them (kernels/lora_reference.py has the layout).

A slot holds one adapter; an adapter a step needs and no slot holds is copied into a free slot, or
into the least recently used one no row of the step needs (the scheduler never lets more than
`max_loras` adapters run at once, backend/sched/lora_slots.py, so there always is one). The banks
are allocated when the engine starts, before the KV cache is sized from the memory left.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Optional

import torch

from backend.models.loader import ModelConfig
from backend.models.lora.peft_format import FUSED, LoRAAdapter, shard_sizes


class LoRABank:
    def __init__(self, cfg: ModelConfig, max_loras: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.num_slots = max_loras
        self.rank = rank  # the rank every slot is padded to (the kernels' tile on GPU)
        sizes = shard_sizes(cfg)
        self.shard_bounds: dict[str, tuple[int, ...]] = {
            fused: tuple(itertools.accumulate((sizes[hf][1] for hf in shards), initial=0))
            for fused, shards in FUSED.items()}
        self.fan_in = {fused: sizes[shards[0]][0] for fused, shards in FUSED.items()}
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(cfg.num_layers):
            for fused, shards in FUSED.items():
                self.a[(layer, fused)] = torch.zeros((max_loras, len(shards) * rank, self.fan_in[fused]),
                                                     dtype=dtype, device=device)
                self.b[(layer, fused)] = torch.zeros((max_loras, self.shard_bounds[fused][-1], rank),
                                                     dtype=dtype, device=device)
        self.holder: list[Optional[str]] = [None] * max_loras   # the adapter in each slot
        self.targets: list[frozenset[str]] = [frozenset()] * max_loras  # its fused projections
        self._used = [0] * max_loras  # when each slot was last needed (LRU)
        self._clock = 0

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in itertools.chain(self.a.values(), self.b.values()))

    def slot_of(self, name: str) -> Optional[int]:
        return self.holder.index(name) if name in self.holder else None

    def slots_for(self, names: Iterable[str], adapters) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """The slot of each adapter `names` lists, copying in those not resident, and the copies
        made (slot, name); `adapters` maps a name to its LoRAAdapter. Raises RuntimeError if they
        are more than the slots."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.num_slots:
            raise RuntimeError(f"a step needs {len(wanted)} LoRA adapters; max_loras is {self.num_slots}")
        self._clock += 1
        slots = {}
        written = []
        for name in wanted:
            slot = self.slot_of(name)
            if slot is None:
                slot = self._free_slot(set(wanted))
                self.write(slot, adapters[name])
                written.append((slot, name))
            self._used[slot] = self._clock
            slots[name] = slot
        return slots, written

    def _free_slot(self, keep: set[str]) -> int:
        free = [s for s, h in enumerate(self.holder) if h is None]
        if free:
            return free[0]
        return min((s for s, h in enumerate(self.holder) if h not in keep), key=self._used.__getitem__)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter's weights into a slot (zero where it has none, padding its rank)."""
        targets = set()
        for key, a_bank in self.a.items():
            a_bank[slot].zero_()
            b_bank = self.b[key]
            b_bank[slot].zero_()
            parts = adapter.weights.get(key)
            if parts is None:
                continue
            bounds = self.shard_bounds[key[1]]
            for i, part in enumerate(parts):
                if part is None:
                    continue
                a, b = part
                r = a.shape[0]
                a_bank[slot, i * self.rank:i * self.rank + r].copy_(a)
                b_bank[slot, bounds[i]:bounds[i + 1], :r].copy_(b)
                targets.add(key[1])
        self.holder[slot] = adapter.name
        self.targets[slot] = frozenset(targets)

    def release(self, name: str) -> None:
        """Forget an unloaded adapter's slot (its weights are overwritten by the next one)."""
        slot = self.slot_of(name)
        if slot is not None:
            self.holder[slot] = None
            self.targets[slot] = frozenset()
