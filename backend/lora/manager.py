"""The engine's adapters: loaded by name (at start and at run time), checked against the base
model, copied into device slots when a step needs them. The runner owns one (`runner.lora`) when
`enable_lora` is on; the engine resolves requests' adapter names through it.

Adapters are held on the host in float32 (their size is small next to the base model's); the
device holds only the resident ones (`LoRABank`). Loading and unloading may come from another
thread than the engine's: a lock guards the name table, and an unloaded adapter's slot is only
released by the engine thread at its next step, so a step never sees a slot change under it.
"""
from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from backend.config import EngineConfig
from backend.loader import ModelConfig
from backend.lora.bank import LoRABank
from backend.lora.peft_format import LoRAAdapter, load_adapter
from backend.lora.sources import LoRALike, LoRARequest, adapter_sources, cache_salt, check_name
from backend.lora.step import LoRAStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedLoRA:
    """What a request needs of its adapter: its name and the root of its prefix-cache keys."""
    name: str
    path: str
    salt: bytes
    rank: int
    modules: tuple[str, ...]


class LoRAManager:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, kernels: bool):
        """`kernels`: run the Triton kernels (CUDA); their tiles want the rank padded to a power of
        two of at least 16. `device`/`dtype`: the banks'."""
        self.config = config
        self.model_cfg = model_cfg
        rank = config.max_lora_rank
        if kernels:
            rank = max(16, 1 << (rank - 1).bit_length())
        self.bank = LoRABank(model_cfg, config.max_loras, rank, dtype, device)
        if kernels:
            from kernels.lora_sgmv import lora_add
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
        for name, path in adapter_sources(config.model_path, config.lora_modules).items():
            self.load(name, path)
        log.info("LoRA: %d adapter(s) loaded (%s); %d slots of rank %d, %.1f MB on %s", len(self._loaded),
                 ", ".join(self._loaded) or "none", config.max_loras, rank, self.bank.num_bytes / 1e6, device)

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
        check_name(name)
        with self._lock:
            known = self._loaded.get(name)
        if known is not None:
            if known.path != str(path):
                raise ValueError(f"LoRA adapter '{name}' is already loaded from {known.path}; unload it first")
            return known
        adapter = load_adapter(name, str(path), self.model_cfg, self.config.max_lora_rank)
        with self._lock:
            info = LoadedLoRA(name, adapter.path, cache_salt(name, next(self._load_ids)), adapter.rank, adapter.modules)
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
    def step(self, runs: list[tuple[int, int, str]], num_rows: int) -> Optional[LoRAStep]:
        """The step's LoRA object for its adapter runs (first row, end row, name); None when no row
        has an adapter."""
        with self._lock:
            released, self._released = self._released, []
            adapters = dict(self._adapters)
        for name in released:
            self.bank.release(name)
        if not runs:
            return None
        missing = sorted({n for _, _, n in runs if n not in adapters})
        if missing:
            raise RuntimeError(f"LoRA adapter(s) {missing} were unloaded while requests still used them")
        slots = self.bank.slots_for((n for _, _, n in runs), adapters)
        return LoRAStep(self.bank, [(a, b, slots[n]) for a, b, n in runs], num_rows, self._lora_add, self._on_device)


def make_lora_manager(config: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module, ops_name: str,
                      device: torch.device) -> Optional[LoRAManager]:
    """The runner's adapters when enable_lora is on (None otherwise): banks in the activations'
    dtype (the delta is added to a projection's output), the Triton kernels with the Triton ops."""
    if not config.enable_lora:
        return None
    dtype = model.compute_dtype or model.embed_tokens.weight.dtype
    return LoRAManager(config, model_cfg, dtype, device, kernels=ops_name == "triton")
