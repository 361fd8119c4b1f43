"""The waiting queue, ordered by (priority, arrival): lower priority values run first, as in vLLM,
and among equals the earlier arrival. A preempted request keeps its place (its arrival number).
No torch here."""
from __future__ import annotations

import bisect
import itertools
from typing import Iterator

from backend.core.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._items: list[tuple[tuple[int, int], Request]] = []
        self._arrivals = itertools.count()

    def push(self, req: Request) -> None:
        if req.arrival_seq is None:
            req.arrival_seq = next(self._arrivals)
        bisect.insort(self._items, ((req.priority, req.arrival_seq), req), key=lambda item: item[0])

    def remove(self, req: Request) -> None:
        for i, (_, r) in enumerate(self._items):
            if r is req:
                del self._items[i]
                return
        raise ValueError(f"{req.seq_id} is not waiting")

    def __contains__(self, req: object) -> bool:
        return any(r is req for _, r in self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter([r for _, r in self._items])

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> Request:
        return self._items[i][1]
