"""Pooling requests on the engine (docs/pooling.md): the runner a checkpoint gets, and a pooling
request made and checked at its door.

A pooling request is prefill-only work in the same in-flight batch as every other: a Request with
max_tokens 1 (so guaranteed_no_evict reserves its prompt's blocks only), greedy, that the worker
answers with its pooled vector when its last prompt chunk has run (backend/worker/pooler.py); it
then finishes, and its blocks go back at once (to the prefix cache, as any prompt's).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

from backend.core.config import EngineConfig
from backend.core.input_guard import int32
from backend.core.pooling import PoolingConfig, PoolingParams, check_params
from backend.core.request import Request
from backend.core.sampling_params import SamplingParams
from backend.models.loader import ModelConfig
from backend.models.pooling_config import resolve_runner

Prompt = Union[str, list[int]]


def engine_pooling(config: EngineConfig, model_cfg: ModelConfig) -> Optional[PoolingConfig]:
    """The pooling configuration of the engine's checkpoint under config.runner; None: it generates.
    Refuses what the pooling runner does not run with."""
    pooling = resolve_runner(config.runner, config.model_path, model_cfg)
    if pooling is None:
        return None
    for bad, why in ((config.tensor_parallel_size > 1, "tensor_parallel_size > 1"),
                     (config.speculative is not None, "speculative_config"),
                     (config.enable_lora, "enable_lora"),
                     (config.batching_mode in ("static", "dynamic"), f"batching_mode {config.batching_mode}")):
        if bad:
            raise ValueError(f"runner pooling does not run with {why} yet (docs/pooling.md)")
    return pooling


def with_classifier_tokens(cfg: ModelConfig, tokenizer) -> ModelConfig:
    """A score head made of LM-head rows (config.json's classifier_from_token, vLLM's key): its tokens'
    ids, read from the tokenizer before the weights load."""
    if not cfg.classifier_tokens:
        return cfg
    if tokenizer is None:
        raise ValueError("config.json: classifier_from_token needs the checkpoint's tokenizer.json")
    ids = tuple(tokenizer.token_to_id(t) for t in cfg.classifier_tokens)
    missing = [t for t, i in zip(cfg.classifier_tokens, ids) if i is None]
    if missing:
        raise ValueError(f"config.json: classifier_from_token {missing[0]!r} is not a token of the tokenizer")
    return dataclasses.replace(cfg, classifier_token_ids=ids)


def refuse_generation(pooling: Optional[PoolingConfig], head: str) -> None:
    """A request for tokens to a pooling model without a language-model head (`head`: ModelConfig's):
    refused, saying what the model serves. (A causal LM served by the pooling runner keeps its head:
    the Python API may mix both kinds in one batch; the doors pool every request of a pooling model.)"""
    if pooling is not None and head:
        what = "embeddings (/v1/embeddings)" if pooling.task == "embed" else "scores (/v1/score, /v1/rerank)"
        raise ValueError(f"this model serves the pooling runner ({what}); it does not generate text")


def make_pooling_request(engine, request_id: str, prompt: Prompt, params: Optional[PoolingParams] = None,
                         truncate_prompt_tokens: Optional[int] = None, priority: int = 0) -> Request:
    """A checked pooling request of `engine` (an LLMEngine): ValueError naming the field and the limit."""
    pooling = engine.pooling
    if pooling is None:
        raise ValueError("this model serves the generate runner: start it with runner pooling (`inflight serve "
                         "--runner pooling`) for embeddings and scores")
    params = params or PoolingParams()
    check_params(params, pooling)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=truncate_prompt_tokens)
    sampling.validate()
    if isinstance(prompt, str) and not prompt:
        raise ValueError("input: an empty string has no tokens to pool")
    ids = engine._prompt_ids(prompt, truncate_prompt_tokens)
    engine.scheduler.check_fits(len(ids), 1, 1, pooling=True)
    request = Request(request_id, ids, sampling, (), seed=0, priority=int32(priority, "priority"))
    request.pooling, request.pooling_params = pooling.pooling_type, params
    return request
