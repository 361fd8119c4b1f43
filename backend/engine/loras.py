"""The engine's face of multi-LoRA: resolve a request's adapter, load and unload adapters at run
time, count requests per adapter for the metrics. Works with LoRA off too (then every adapter
name is refused, saying how to turn it on)."""
from __future__ import annotations

from collections import Counter
from typing import Optional

from backend.worker.lora.manager import LoadedLoRA, LoRAManager
from backend.core.lora import LoRALike, LoRARequest, lora_name_of


class EngineLoRAs:
    def __init__(self, manager: Optional[LoRAManager], scheduler):
        self.manager = manager
        self.scheduler = scheduler

    def _enabled(self, what: str) -> LoRAManager:
        if self.manager is None:
            raise ValueError(f"{what}: LoRA is not enabled on this engine (set enable_lora=true, and load "
                             "adapters through multi_lora.json or lora_modules; docs/lora.md)")
        return self.manager

    def resolve(self, lora: LoRALike) -> Optional[LoadedLoRA]:
        if lora is None:
            return None
        return self._enabled(f"lora_name '{lora_name_of(lora)}'").resolve(lora)

    def load(self, name: str, path: str) -> LoadedLoRA:
        return self._enabled(f"loading LoRA adapter '{name}'").load(name, path)

    def unload(self, name: str) -> None:
        """Unload an adapter no request uses (ValueError naming how many do)."""
        manager = self._enabled(f"unloading LoRA adapter '{name}'")
        users = sum(1 for r in self.scheduler.iter_requests() if r.lora_name == name)
        if users:
            raise ValueError(f"LoRA adapter '{name}' is in use by {users} request(s); unload it once they finish")
        manager.unload(name)

    def names(self) -> list[str]:
        return self.manager.names() if self.manager is not None else []

    def name_of_salt(self, salt: bytes) -> Optional[str]:
        """The loaded adapter whose prefix-cache root is `salt` (KV-cache events name it), if any."""
        for name in self.names():
            info = self.manager.info(name)
            if info is not None and info.salt == salt:
                return name
        return None

    def requests(self) -> dict[str, dict[str, int]]:
        """Every loaded adapter -> its running and waiting requests (sequences, as the engine's own
        counts), for the `inflight_lora_requests` gauge."""
        if self.manager is None:
            return {}
        running = Counter(r.lora_name for r in self.scheduler.running if r.lora_name)
        waiting = Counter(r.lora_name for r in self.scheduler.waiting if r.lora_name)
        names = dict.fromkeys(self.manager.names())
        names.update(dict.fromkeys(running))
        names.update(dict.fromkeys(waiting))
        return {n: {"running": running[n], "waiting": waiting[n]} for n in names}


__all__ = ["EngineLoRAs", "LoRARequest"]
