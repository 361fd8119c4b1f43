"""Requests whose constraint is still compiling (vLLM's WAITING_FOR_FSM), kept out of the scheduler.

A request whose constraint is not in the compiler's cache waits here, in status
`WAITING_FOR_GRAMMAR`, while a worker compiles it (compile_pool.py): it holds no KV block, is
nobody's head of the queue and has no place in it, so admission order, backfill reservations and
priorities are those of the requests that can run. Once its grammar is ready the engine queues it
(its arrival time, for queue-time metrics, stays the real one); a refused constraint ends it with
an error naming the field. Only the engine thread adds and takes; the pool threads that complete the
futures only wake it (`on_ready`, AsyncEngine's condition). No torch here.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Iterator, Optional

from backend.core.errors import QueueFullError
from backend.core.request import Request, RequestStatus


class GrammarWaitlist:
    def __init__(self) -> None:
        self._waiting: dict[str, tuple[Request, Future]] = {}  # by request id (its first completion)
        self._event = threading.Event()  # set whenever a future completes
        self.on_ready: Optional[Callable[[], None]] = None

    def add(self, request: Request, future: Future) -> None:
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._waiting[request.request_id] = (request, future)
        future.add_done_callback(self._done)  # at once when it is done already

    def _done(self, _future: Future) -> None:
        self._event.set()
        if self.on_ready is not None:
            self.on_ready()

    def take_ready(self) -> list[tuple[Request, Future]]:
        """The requests whose compile has ended (in arrival order), removed from the list."""
        self._event.clear()
        ready = [(r, f) for r, f in self._waiting.values() if f.done()]
        for request, _ in ready:
            del self._waiting[request.request_id]
        return ready

    def take_compiled(self, grammars) -> tuple[list[Request], list[Request]]:
        """(the requests whose grammar is ready, now attached and WAITING; those refused, with
        their error and error_kind set), taken out of the list. `grammars`: the ConstraintCompiler."""
        ready, refused = [], []
        for request, future in self.take_ready():
            request.pending_grammar = None
            try:
                request.grammar = grammars.new_state(future.result(), request.params)
            except Exception as exc:  # the refusal names the field; a busy compiler says retry later
                request.error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                request.error_kind = ("invalid" if isinstance(exc, ValueError) else
                                      "unavailable" if isinstance(exc, QueueFullError) else None)
                refused.append(request)
                continue
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready, refused

    def has_ready(self) -> bool:
        return any(f.done() for _, f in self._waiting.values())

    def remove(self, request_id: str) -> Optional[Request]:
        """Take a request out (an abort); its compile goes on and its grammar is cached."""
        entry = self._waiting.pop(request_id, None)
        return entry[0] if entry is not None else None

    def wait(self, timeout: float) -> bool:
        """Block until a compile ends (or `timeout` s): for a caller with nothing else to run."""
        return self._event.wait(timeout)

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter([r for r, _ in self._waiting.values()])
