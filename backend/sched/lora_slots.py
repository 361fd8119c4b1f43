"""LoRA slots in admission: at most `max_loras` adapters among the running requests, so every step's
rows fit in the device's adapter slots (backend/worker/lora/bank.py). No torch here.

A waiting request whose adapter is running, or that finds a slot free, may start (the capacity
policy still decides on blocks). One whose adapter would need a slot beyond `max_loras` waits in
the queue, never refused. From then on, in that admission pass, requests of other adapters less
urgent than it wait behind it too, even those whose adapter is running: otherwise a steady stream
of the running adapters' requests would keep every slot taken and it would never start. So the
running adapters drain and a slot frees for it. Requests of the base model (no adapter) need no
slot and are never held back by this.
"""
from __future__ import annotations

from collections import Counter

from backend.core.request import Request


class LoRASlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._running: Counter = Counter()
        self._blocked = False

    def begin(self, running: list[Request]) -> None:
        """At the start of an admission pass: the adapters the running requests hold."""
        self._running = Counter(r.lora_name for r in running if r.lora_name)
        self._blocked = False

    def may_start(self, req: Request) -> bool:
        """Whether req's adapter lets it start now (base-model requests always may)."""
        name = req.lora_name
        if not name:
            return True
        if self._blocked:
            return False  # a more urgent request waits for a slot: adapters queue behind it
        if name in self._running or len(self._running) < self.max_loras:
            return True
        self._blocked = True
        return False

    def started(self, req: Request) -> None:
        if req.lora_name:
            self._running[req.lora_name] += 1


def adapters_of(requests) -> int:
    """How many distinct adapters these requests use (the invariant's measure)."""
    return len({r.lora_name for r in requests if r.lora_name})
