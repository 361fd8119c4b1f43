"""The error a refused request is answered with: its message and the Triton error code (INVALID_ARG,
UNAVAILABLE, INTERNAL), and which exception gets which. No Triton imports."""
from __future__ import annotations

from backend.core.errors import EngineDeadError, QueueFullError


class Error(str):
    """An error message for a client, with the Triton error code to answer it with.

    INVALID_ARG: the request is wrong (fix it; gRPC INVALID_ARGUMENT, HTTP 400).
    UNAVAILABLE: the server cannot take it now (the queue is full, it is shutting down): retry later.
    INTERNAL: the server failed it (a failed model step)."""
    code: str

    def __new__(cls, message: str, code: str = "INTERNAL") -> "Error":
        self = super().__new__(cls, message)
        self.code = code
        return self


class ServerClosing(RuntimeError):
    """The model is being unloaded: new requests are refused."""


def error_for(exc: BaseException) -> Error:
    """The message and code a refused request gets for an exception."""
    if isinstance(exc, ValueError):
        return Error(str(exc) or type(exc).__name__, "INVALID_ARG")
    if isinstance(exc, (ServerClosing, QueueFullError, EngineDeadError)):
        return Error(str(exc) or type(exc).__name__, "UNAVAILABLE")
    return Error(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, "INTERNAL")
