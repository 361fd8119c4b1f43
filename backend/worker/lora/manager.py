"""The engine's adapters: loaded by name (at start and at run time), checked against the base
model, copied into device slots when a step needs them. The runner owns one (`runner.lora`) when
`enable_lora` is on; the engine resolves requests' adapter names through it.

Adapters are held on the host in float32 (their size is small next to the base model's); the
device holds only the resident ones (`LoRABank`). Loading and unloading may come from another
thread than the engine's: a lock guards the name table, and an unloaded adapter's slot is only
released by the engine thread at its next step, so a step never sees a slot change under it.

Under tensor parallelism (backend/worker/lora/tensor_parallel.py) rank 0's manager loads, checks and
assigns slots as with one rank, holding its shard of each adapter; the other ranks' managers only
follow: they write into the slots rank 0 names what its step message says.
"""
from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from backend.core.config import EngineConfig
from backend.models.loader import ModelConfig
from backend.worker.lora.bank import LoRABank
from backend.models.lora.peft_format import LoRAAdapter, load_adapter
from backend.core.lora import LoRALike, LoRARequest, adapter_sources, cache_salt, check_adapter_name, check_name
from backend.worker.lora.step import LoRAStep
from backend.worker.lora.tensor_parallel import AdapterDirectory, FollowedAdapters, shard_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedLoRA:
    """What a request needs of its adapter: its name and the root of its prefix-cache keys."""
    name: str
    path: str
    salt: bytes
    rank: int
    modules: tuple[str, ...]
    load_id: int = 0  # unique per load: how the other tensor-parallel ranks find it


class LoRAManager:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, kernels: bool, tp=None):
        """`kernels`: run the Triton kernels (CUDA); their tiles want the rank padded to a power of
        two of at least 16. `device`/`dtype`: the banks'. `model_cfg`: the whole model's (adapters
        are checked against it); `tp`: this rank's tensor-parallel group (None: one rank)."""
        self.config = config
        self.model_cfg = model_cfg
        rank = config.max_lora_rank
        if kernels:
            rank = max(16, 1 << (rank - 1).bit_length())
        self.plan = tp.plan if tp is not None else None
        self.leader = tp is None or tp.rank == 0
        self.directory = AdapterDirectory(tp.store) if tp is not None else None
        self.followed = None if self.leader else FollowedAdapters(
            self.directory, self.plan, model_cfg, config.max_lora_rank, keep=4 * config.max_loras)
        self.bank = LoRABank(self.plan.local_config(model_cfg) if self.plan else model_cfg, config.max_loras, rank,
                             dtype, device)
        if kernels:
            from kernels.gpu.lora_sgmv import lora_add
            self._lora_add, self._on_device = lora_add, True
            LoRAStep.warm_up(self.bank, lora_add)
        else:
            from kernels.lora_reference import lora_add
            self._lora_add, self._on_device = lora_add, False
        self._lock = threading.Lock()
        self._adapters: dict[str, LoRAAdapter] = {}
        self._loaded: dict[str, LoadedLoRA] = {}
        self._released: list[str] = []  # unloaded, their slots freed at the next step
        self._load_ids = itertools.count(1)
        if not self.leader:
            return
        self._load_at_start(adapter_sources(config.model_path, config.lora_modules))
        log.info("LoRA: %d adapter(s) loaded (%s); %d slots of rank %d, %.1f MB on %s", len(self._loaded),
                 ", ".join(self._loaded) or "none", config.max_loras, rank, self.bank.num_bytes / 1e6, device)

    def _load_at_start(self, sources: dict[str, str]) -> None:
        """Load every configured adapter. A bad one stops the start, as vLLM's --lora-modules does,
        with one line per bad adapter; with skip_invalid_lora_adapters the server starts with the
        good ones and logs those lines instead."""
        failures = []
        for name, path in sources.items():
            try:
                self.load(name, path)
            except ValueError as exc:
                failures.append(str(exc))
        if not failures:
            return
        if not self.config.skip_invalid_lora_adapters:
            raise ValueError(f"{len(failures)} of {len(sources)} LoRA adapter(s) cannot be loaded, so the model does "
                             "not start (skip_invalid_lora_adapters=true starts it with the others):\n"
                             + "\n".join(failures))
        for line in failures:
            log.error("%s; skipped (skip_invalid_lora_adapters=true)", line)

    # -- names ------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def info(self, name: str) -> Optional[LoadedLoRA]:
        with self._lock:
            return self._loaded.get(name)

    def load(self, name: str, path: str) -> LoadedLoRA:
        """Read, check and register an adapter (ValueError naming the adapter and the module when it
        does not fit the base model). Loading a name again with the same folder is a no-op."""
        check_adapter_name(name, "LoRA adapter", self.config.served_model_name)
        with self._lock:
            known = self._loaded.get(name)
        if known is not None:
            if known.path != str(path):
                raise ValueError(f"LoRA adapter '{name}' is already loaded from {known.path}; unload it first")
            return known
        adapter = load_adapter(name, str(path), self.model_cfg, self.config.max_lora_rank)
        if self.plan is not None:
            adapter = shard_adapter(adapter, self.plan)
        load_id = next(self._load_ids)  # itertools.count: one id per call, whatever the thread
        if self.directory is not None:  # before any step can name it, and outside the lock the step takes
            self.directory.publish(load_id, name, adapter.path)
        info = LoadedLoRA(name, adapter.path, cache_salt(name, load_id), adapter.rank, adapter.modules, load_id)
        with self._lock:
            most = self.config.max_cpu_loras
            if most and len(self._loaded) >= most:  # checked again here: two loads may race
                raise ValueError(f"LoRA adapter '{name}': {len(self._loaded)} adapters are loaded ({', '.join(self._loaded)}), "
                                 f"the most max_cpu_loras allows ({most}); unload one first")
            if name in self._loaded:
                raise ValueError(f"LoRA adapter '{name}' is already loaded from {self._loaded[name].path}; unload it first")
            self._adapters[name] = adapter
            self._loaded[name] = info
        log.info("LoRA adapter '%s' loaded from %s: rank %d, %s", name, adapter.path, adapter.rank,
                 ", ".join(adapter.modules))
        return info

    def unload(self, name: str) -> None:
        with self._lock:
            if self._loaded.pop(name, None) is None:
                raise ValueError(f"LoRA adapter '{name}' is not loaded; loaded: {', '.join(self._loaded) or 'none'}")
            self._adapters.pop(name, None)
            self._released.append(name)

    def resolve(self, lora: LoRALike) -> Optional[LoadedLoRA]:
        """A request's adapter (a name or a LoRARequest) -> the loaded adapter; a LoRARequest with a
        path loads it on first use. ValueError listing what is loaded for an unknown name."""
        if lora is None:
            return None
        name = check_name(lora.lora_name if isinstance(lora, LoRARequest) else lora)
        info = self.info(name)
        if info is None and isinstance(lora, LoRARequest) and lora.lora_path:
            info = self.load(name, lora.lora_path)
        if info is None:
            loaded = self.names()
            raise ValueError(f"LoRA adapter '{name}' is not loaded; loaded adapters: "
                             f"{', '.join(loaded) if loaded else 'none'}")
        return info

    # -- one step (the engine thread) ---------------------------------------------------------------
    def assign(self, runs: list[tuple[int, int, str]]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """Rank 0: the step's adapter runs (first row, end row, name) by slot, copying the adapters
        not resident into slots, and those copies as (slot, load id) for the other ranks."""
        with self._lock:
            released, self._released = self._released, []
            adapters = dict(self._adapters)
            load_ids = {name: info.load_id for name, info in self._loaded.items()}
        for name in released:
            self.bank.release(name)
        if not runs:
            return [], []
        missing = sorted({n for _, _, n in runs if n not in adapters})
        if missing:
            raise RuntimeError(f"LoRA adapter(s) {missing} were unloaded while requests still used them")
        slots, written = self.bank.slots_for((n for _, _, n in runs), adapters)
        return [(a, b, slots[n]) for a, b, n in runs], [(slot, load_ids[name]) for slot, name in written]

    def step(self, runs: list[tuple[int, int, int]], writes: list[tuple[int, int]], num_rows: int) -> Optional[LoRAStep]:
        """The step's LoRA object for its adapter runs by slot (None when no row has an adapter); a
        rank other than 0 first makes rank 0's slot writes (rank 0 made them in `assign`)."""
        if not self.leader:
            for slot, load_id in writes:
                self.bank.write(slot, self.followed.get(load_id))
        if not runs:
            return None
        return LoRAStep(self.bank, runs, num_rows, self._lora_add, self._on_device)


def make_lora_manager(config: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module, ops_name: str,
                      device: torch.device, tp=None) -> Optional[LoRAManager]:
    """The runner's adapters when enable_lora is on (None otherwise): banks in the activations'
    dtype (the delta is added to a projection's output), the Triton kernels with the Triton ops.
    `model_cfg`: the whole model's, also under tensor parallelism (`tp`, the rank's group)."""
    if not config.enable_lora:
        return None
    dtype = model.compute_dtype or model.embed_tokens.weight.dtype
    return LoRAManager(config, model_cfg, dtype, device, kernels=ops_name == "triton", tp=tp)
