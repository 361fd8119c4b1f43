"""Every error the engine raises on purpose, in one place, free of torch: the Triton adapter and the
OpenAI server import it to map errors to codes with `isinstance` before any model is loaded."""


class EngineError(RuntimeError):
    """Base of the engine's own runtime errors (a bad request is a `RequestError` instead)."""


class RequestError(ValueError):
    """The request is wrong (a field out of range, a prompt too long): the message names the field
    and the limit. A ValueError, so callers that catch ValueError keep working."""


class QueueFullError(EngineError):
    """The waiting queue holds max_queue_size requests already (retry later)."""


class EngineDeadError(EngineError):
    """The engine is shut down, or stopped after an internal error it could not recover from."""


class NoFreeBlocksError(EngineError):
    """The KV cache has no free block for a growth the scheduler asked for (a scheduler bug)."""


class RankLostError(EngineDeadError):
    """A tensor-parallel rank died or its collective failed: the engine cannot compute any step."""
