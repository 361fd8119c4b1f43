"""inflight's engine: paged KV cache, in-flight batching, Llama-family models. No Triton here.

The public names load lazily, so `import backend.core.config` (or `backend.sched.factory`, ...) does not pull
in torch: a bad config is refused before the model's libraries load.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "backend.engine.llm",
    "SamplingParams": "backend.core.sampling_params",
    "EngineConfig": "backend.core.config",
    "RequestOutput": "backend.core.outputs",
    "LoRARequest": "backend.core.lora",
    "PoolingParams": "backend.core.pooling",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'backend' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)
