"""inflight's engine: paged KV cache, in-flight batching, Llama-family models. No Triton here."""
from backend.config import EngineConfig
from backend.llm import LLM
from backend.outputs import RequestOutput
from backend.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
