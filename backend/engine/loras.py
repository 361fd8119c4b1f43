"""The engine's face of multi-LoRA: resolve a request's adapter, load and unload adapters at run
time, count requests per adapter for the metrics. Works with LoRA off too (then every adapter
name is refused, saying how to turn it on).

Unloading at run time drains (`begin_unload`): from then on the adapter is no longer listed and
requests naming it are refused as not loaded, while those already holding it run to their end;
the engine thread (`settle`, each turn of its loop) unloads it once none is left, which frees its
slot, and sets the event the caller waits on."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable, Optional

from backend.worker.lora.manager import LoadedLoRA, LoRAManager
from backend.core.lora import LoRALike, LoRARequest, lora_name_of


class EngineLoRAs:
    def __init__(self, manager: Optional[LoRAManager], scheduler):
        self.manager = manager
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._draining: dict[str, threading.Event] = {}  # unloading: name -> set once unloaded
        self.loads_total = self.unloads_total = 0  # at run time (inflight_lora_loads_total / _unloads_total)

    def _enabled(self, what: str) -> LoRAManager:
        if self.manager is None:
            raise ValueError(f"{what}: LoRA is not enabled on this engine (set enable_lora=true, and load "
                             "adapters through multi_lora.json or lora_modules; docs/lora.md)")
        return self.manager

    def resolve(self, lora: LoRALike) -> Optional[LoadedLoRA]:
        if lora is None:
            return None
        name = lora_name_of(lora)
        self.check_open(name)
        return self._enabled(f"lora_name '{name}'").resolve(lora)

    def check_open(self, name: Optional[str]) -> None:
        """Refuse a request naming an adapter that is being unloaded (as one never loaded is)."""
        if name is not None and name in self._draining:
            raise ValueError(f"LoRA adapter '{name}' is not loaded (it is being unloaded); loaded adapters: "
                             f"{', '.join(self.names()) or 'none'}")

    def load(self, name: str, path: str) -> LoadedLoRA:
        manager = self._enabled(f"loading LoRA adapter '{name}'")
        if name in self._draining:
            raise ValueError(f"LoRA adapter '{name}' is being unloaded; load it again once its unload has finished")
        known = manager.info(name)
        loaded = manager.load(name, path)
        self.loads_total += loaded is not known
        return loaded

    def unload(self, name: str, compiling: Iterable = ()) -> None:
        """Unload an adapter no request uses, running, queued or in `compiling` (those whose
        constraint compiles, not yet queued); else a ValueError naming how many of each hold it."""
        manager = self._enabled(f"unloading LoRA adapter '{name}'")
        queued = {id(r) for r in self.scheduler.waiting}
        held: dict[str, set[str]] = {"running": set(), "queued": set()}
        for r in self.scheduler.iter_requests():  # (a padded batch's finished members keep their rows: running)
            if r.lora_name == name:
                held["queued" if id(r) in queued else "running"].add(r.request_id)
        held["compiling their constraint"] = {r.request_id for r in compiling if r.lora_name == name}
        users = set().union(*held.values())
        if users:
            parts = ", ".join(f"{len(ids)} {where}" for where, ids in held.items() if ids)
            raise ValueError(f"LoRA adapter '{name}' is in use by {len(users)} request(s) ({parts}); unload it "
                             "once they finish")
        manager.unload(name)

    def begin_unload(self, name: str) -> threading.Event:
        """Start draining `name` (ValueError if it is not loaded); the event is set once it is
        unloaded. A second call while it drains waits on the same event."""
        manager = self._enabled(f"unloading LoRA adapter '{name}'")
        with self._lock:
            if name in self._draining:
                return self._draining[name]
            if manager.info(name) is None:
                raise ValueError(f"LoRA adapter '{name}' is not loaded; loaded adapters: {', '.join(self.names()) or 'none'}")
            done = self._draining[name] = threading.Event()
        return done

    @property
    def draining(self) -> bool:
        return bool(self._draining)

    def settle(self, pending: Iterable = ()) -> int:
        """The engine thread: unload each draining adapter that no request holds any more, in the
        scheduler or in `pending` (requests not yet handed to it). Returns how many it unloaded."""
        if not self._draining:
            return 0
        used = {r.lora_name for r in (*self.scheduler.iter_requests(), *pending) if r.lora_name}
        with self._lock:
            done = [n for n in self._draining if n not in used]
            events = [self._draining.pop(n) for n in done]
        for name, event in zip(done, events):
            self.manager.unload(name)  # its slot is released at the next step
            self.unloads_total += 1
            event.set()
        return len(done)

    def figures(self) -> dict[str, int]:
        """The engine's stats() figures of run-time loading; none without LoRA (the metrics table's
        series `when=LORA`)."""
        if self.manager is None:
            return {}
        return {"lora_loads_total": self.loads_total, "lora_unloads_total": self.unloads_total}

    def names(self) -> list[str]:
        """The adapters requests may name now (those being unloaded are no longer listed)."""
        if self.manager is None:
            return []
        return [n for n in self.manager.names() if n not in self._draining]

    def name_of_salt(self, salt: bytes) -> Optional[str]:
        """The loaded adapter whose prefix-cache root is `salt` (KV-cache events name it), if any."""
        for name in self.manager.names() if self.manager is not None else ():
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
