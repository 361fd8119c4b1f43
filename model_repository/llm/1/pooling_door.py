"""The `llm` model's pooling requests (docs/pooling.md): a model served by the pooling runner
(`runner` pooling, or auto on an embedding or reranker checkpoint) answers `text_input` or
`input_ids` with `embedding` (FP32: the embedding, or a classifier's scores) and
`num_input_tokens`. `pooling_task` (embed | classify, what the OpenAI port's /v1/embeddings,
/v1/score and /v1/rerank send) must match what the model does; `dimensions` asks a Matryoshka
embedding's first n values. A generate-runner model refuses both, and a pooling model refuses a
request that asks for outputs without `embedding` (a text generation request)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from backend.core.pooling import PoolingParams


def pooling_params(parsed: Any, engine: Any, outputs: Optional[frozenset]) -> Optional[PoolingParams]:
    """The request's PoolingParams when the model pools it, None when it generates; ValueError
    (a 400 naming the input) for a request the model cannot serve."""
    pooling = getattr(getattr(engine, "engine", None), "pooling", None)
    task, dims = parsed.pooling_task, parsed.dimensions
    if pooling is None:
        if task is not None or dims is not None:
            raise ValueError(f"{'pooling_task' if task is not None else 'dimensions'}: this model serves the generate "
                             "runner (text); start it with runner pooling (`inflight serve --runner pooling`) for "
                             "embeddings and scores")
        return None
    if task is None and outputs and "embedding" not in outputs:
        raise ValueError("this model serves the pooling runner (embeddings and scores): it does not generate text; "
                         "ask for the embedding output (the OpenAI port: /v1/embeddings, /v1/score, /v1/rerank)")
    if task is not None and task != pooling.task:
        have = "an embedding model (/v1/embeddings)" if pooling.task == "embed" else \
            "a classifier (a cross-encoder: /v1/score, /v1/rerank)"
        raise ValueError(f"pooling_task '{task}': this model is {have}")
    if parsed.stream:
        raise ValueError("stream: a pooling request has one answer; send stream=false")
    return PoolingParams(dimensions=dims)


def pooled_tensors(out: Any) -> dict[str, np.ndarray]:
    """A pooled request's response: its vector and its prompt's length."""
    return {"embedding": np.asarray(out.pooled, dtype=np.float32),
            "num_input_tokens": np.array([len(out.prompt_token_ids)], dtype=np.uint32)}
