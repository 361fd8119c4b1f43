"""Every error the engine raises on purpose, in one place, free of torch: the Triton adapter and the
OpenAI server import it to map errors to codes with `isinstance` before any model is loaded."""
from __future__ import annotations

import math
import re
from typing import Optional

# An overload refusal's message ends "retry after N s": Triton's error carries only the message, and
# the OpenAI server reads N back into its Retry-After header (openai_server/triton_backend.py).
_RETRY_AFTER = re.compile(r"retry after (\d+) s\b")


def retry_after_seconds(seconds: Optional[float]) -> int:
    """Whole seconds to retry after (HTTP's Retry-After): at least 1."""
    return max(1, math.ceil(seconds)) if seconds is not None and math.isfinite(seconds) else 1


def retry_after_of(message: str) -> Optional[int]:
    """The seconds an overload refusal's message says to retry after (None: it says none)."""
    found = _RETRY_AFTER.search(message)
    return int(found.group(1)) if found else None


class EngineError(RuntimeError):
    """Base of the engine's own runtime errors (a bad request is a `RequestError` instead)."""


class RequestError(ValueError):
    """The request is wrong (a field out of range, a prompt too long): the message names the field
    and the limit. A ValueError, so callers that catch ValueError keep working."""


class QueueFullError(EngineError):
    """The waiting queue holds max_queue_size requests already (retry later). `retry_after`: the
    seconds the caller should wait (the queue's expected drain time, backend/sched/drain.py), when
    the engine has an estimate; `reason` labels the rejection counter."""
    reason = "queue_full"

    def __init__(self, message: str = "", retry_after: Optional[float] = None):
        if retry_after is not None:
            message = f"{message}; retry after {retry_after_seconds(retry_after)} s"
        super().__init__(message)
        self.retry_after = None if retry_after is None else retry_after_seconds(retry_after)


class TTFTTargetError(QueueFullError):
    """The queue cannot meet the request's time-to-first-token target (`ttft_target_ms`): refused
    at arrival, with the seconds after which it could (retry later)."""
    reason = "ttft_target"


class EngineDeadError(EngineError):
    """The engine is shut down, or stopped after an internal error it could not recover from."""


class NoFreeBlocksError(EngineError):
    """The KV cache has no free block for a growth the scheduler asked for (a scheduler bug)."""


class RankLostError(EngineDeadError):
    """A tensor-parallel rank died or its collective failed: the engine cannot compute any step."""
