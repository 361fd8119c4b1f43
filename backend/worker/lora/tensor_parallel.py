"""LoRA under tensor parallelism: every rank holds its own shard of each resident adapter.

Rank 0 decides everything, as it does for the rest of a step: which adapter goes into which slot
(`LoRAManager.assign`). A step then carries its adapter runs by slot and the slot writes rank 0
made (backend/worker/step_inputs.py's LoRA parts of the step message), and every other rank makes the same
writes. It finds the adapter by its load id in the group's rendezvous store, where rank 0 wrote the
adapter's name and folder when it loaded it (at start or at run time), so adapters loaded while
serving reach every rank with no message of their own. A rank on another machine reads the same
folder path there, as it reads the model's.

Each rank keeps its part of A and B (backend/models/parallel/plan.py's `shard_lora`): column-parallel
q/k/v and gate/up keep B's rows of the rank's output columns; row-parallel o_proj and down_proj
keep A's columns of the rank's inputs, and their deltas join the partial outputs before the
all-reduce (backend/worker/lora/step.py's `lora_project`). No collective is added.
"""
from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from pathlib import Path

from backend.models.loader import ModelConfig
from backend.models.lora.peft_format import FUSED, LoRAAdapter, load_adapter

STORE_KEY = "inflight/lora/"  # + load id: {"name", "path"} of an adapter rank 0 loaded


def shard_adapter(adapter: LoRAAdapter, plan) -> LoRAAdapter:
    """The adapter's part that rank `plan.rank` holds (a ShardPlan)."""
    weights = {key: [None if part is None else plan.shard_lora(FUSED[key[1]][i], *part) for i, part in enumerate(parts)]
               for key, parts in adapter.weights.items()}
    return dataclasses.replace(adapter, weights=weights)


class AdapterDirectory:
    """The adapters rank 0 loaded, by load id, in the group's store."""

    def __init__(self, store):
        self.store = store

    def publish(self, load_id: int, name: str, path: str) -> None:
        """Absolute: a rank's working directory need not be rank 0's."""
        self.store.set(f"{STORE_KEY}{load_id}", json.dumps({"name": name, "path": str(Path(path).resolve())}))

    def lookup(self, load_id: int) -> tuple[str, str]:
        entry = json.loads(self.store.get(f"{STORE_KEY}{load_id}"))  # set before the step that needs it
        return entry["name"], entry["path"]


class FollowedAdapters:
    """A rank other than 0: its shards of the adapters rank 0 writes into slots, by load id, read
    from their folders on first use and kept for the next time a slot takes them again (the most
    recently used `keep`)."""

    def __init__(self, directory: AdapterDirectory, plan, model_cfg: ModelConfig, max_lora_rank: int, keep: int):
        self.directory, self.plan, self.model_cfg, self.max_lora_rank = directory, plan, model_cfg, max_lora_rank
        self.keep = max(1, keep)
        self._held: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def get(self, load_id: int) -> LoRAAdapter:
        adapter = self._held.pop(load_id, None)
        if adapter is None:
            name, path = self.directory.lookup(load_id)
            adapter = shard_adapter(load_adapter(name, path, self.model_cfg, self.max_lora_rank), self.plan)
        self._held[load_id] = adapter
        while len(self._held) > self.keep:
            self._held.popitem(last=False)
        return adapter
