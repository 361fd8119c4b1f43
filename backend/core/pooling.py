"""Pooling (the `pooling` runner, docs/pooling.md): what a model pools and how, and what one
request asks of it. Data only; no torch.

A pooling model answers a prompt with one vector instead of tokens: the hidden state (after the
final norm) pooled over the prompt (`PoolingConfig.pooling_type`: the last token's, the mean of
every token's, or the first token's, as sentence-transformers' Pooling module and vLLM's pooler
name them), then, for an embedding model, cut to `dimensions` (Matryoshka) and normalized; for a
classifier (a cross-encoder reranker: `*ForSequenceClassification`, or Qwen3-Reranker's yes/no
logits) through its score head and a sigmoid (one label) or a softmax (several), as vLLM and
sentence-transformers' CrossEncoder do. The worker pools and runs the head (backend/worker/pooler.py);
`finish_pooled` applies the per-request part on the engine side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

RUNNERS = ("auto", "generate", "pooling")  # EngineConfig.runner (vLLM's --runner); auto: by the checkpoint
POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("embed", "classify")  # classify: the model's score head (/v1/score, /v1/rerank)


@dataclass(frozen=True)
class PoolingConfig:
    """How a pooling model pools: read once from its checkpoint (backend/models/pooling_config.py)."""
    task: str = "embed"
    pooling_type: str = "last"
    normalize: bool = True  # embed: L2-normalize (sentence-transformers' Normalize module)
    num_labels: int = 0  # classify: the score head's outputs
    # embed: the sizes `dimensions` may ask (Matryoshka); () none; None: any size up to hidden_size
    matryoshka_dimensions: Optional[tuple[int, ...]] = ()
    hidden_size: int = 0

    @property
    def whole_prompt(self) -> bool:
        """Every prompt token's hidden state is needed (mean, and the first token's for cls): no
        prefix-cache hit may skip computing them."""
        return self.pooling_type != "last"


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's settings (vLLM's PoolingParams)."""
    dimensions: Optional[int] = None  # embed: keep the first n values (Matryoshka), then normalize
    normalize: Optional[bool] = None  # None: the model's


def check_params(params: PoolingParams, config: PoolingConfig) -> None:
    """Refuse, naming the field, what the model cannot give."""
    if params.dimensions is None:
        return
    if config.task != "embed":
        raise ValueError("dimensions: this model scores (a classifier); it has no embedding to shorten")
    dims = params.dimensions
    if isinstance(dims, bool) or not isinstance(dims, int):
        raise ValueError(f"dimensions must be an integer; got {dims!r}")
    allowed = config.matryoshka_dimensions
    if allowed == ():
        raise ValueError(f"dimensions: this model does not support Matryoshka embeddings (its config declares no "
                         f"matryoshka_dimensions / is_matryoshka); leave dimensions out to get all {config.hidden_size}")
    if allowed is None:
        if not 1 <= dims <= config.hidden_size:
            raise ValueError(f"dimensions must be in [1, {config.hidden_size}]; got {dims}")
    elif dims not in allowed:
        raise ValueError(f"dimensions must be one of {', '.join(map(str, allowed))} (the model's "
                         f"matryoshka_dimensions); got {dims}")


def finish_pooled(values: Sequence[float], params: PoolingParams, config: PoolingConfig) -> list[float]:
    """The worker's pooled output (the hidden state, or the score head's logits) -> what the
    caller gets: an embedding cut to `dimensions` and normalized, or the head's probabilities."""
    out = [float(v) for v in values]
    if config.task == "classify":
        if len(out) == 1:
            return [_sigmoid(out[0])]
        top = max(out)
        exps = [math.exp(v - top) for v in out]
        total = sum(exps)
        return [e / total for e in exps]
    if params.dimensions is not None:
        out = out[:params.dimensions]
    if config.normalize if params.normalize is None else params.normalize:
        norm = math.sqrt(sum(v * v for v in out))
        out = [v / max(norm, 1e-12) for v in out]  # torch.nn.functional.normalize's eps
    return out


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
