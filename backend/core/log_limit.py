"""A log line that a client can make happen is written at most once per interval: the others of
the interval are counted, and the next line that goes out says how many were left out. A flood of
bad requests then costs a few lines, not the disk (issue 46: 71 MB of WARNINGs in 8 s). No torch."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable


class LimitedLog:
    """`warning`/`error` through `log`, at most one line per `interval_s` seconds."""

    def __init__(self, log: logging.Logger, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        self._next = float("-inf")
        self.left_out = 0  # lines not written since the last one that was

    def warning(self, message: str, *args: Any, **kwargs: Any) -> bool:
        return self._emit(logging.WARNING, message, args, kwargs)

    def error(self, message: str, *args: Any, **kwargs: Any) -> bool:
        return self._emit(logging.ERROR, message, args, kwargs)

    def _emit(self, level: int, message: str, args: tuple, kwargs: dict) -> bool:
        now = self.clock()
        if now < self._next:
            self.left_out += 1
            return False
        if self.left_out:
            message += f" ({self.left_out} more like it in the last {self.interval_s:g} s were not logged)"
        self.log.log(level, message, *args, **kwargs)
        self._next, self.left_out = now + self.interval_s, 0
        return True
