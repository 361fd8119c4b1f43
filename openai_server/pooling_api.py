"""/v1/embeddings (OpenAI's shape), /v1/score and /v1/rerank (vLLM's, the Jina/Cohere rerank shape) on
a model the pooling runner serves (docs/pooling.md). Each input is one Triton request to the `llm`
model with `pooling_task` (embed | classify), answered with its `embedding` output; a call's inputs
run at once, in the same in-flight batches as everything else.

- embeddings: `input` a string, a list of strings, a list of token ids or a list of such lists;
  `encoding_format` float or base64 (little-endian float32, as OpenAI); `dimensions` (Matryoshka
  models only, else the model's 400 naming it); `truncate_prompt_tokens` (vLLM's: the last k tokens).
- score: `text_1` and `text_2` (a string or a list each: one against many, or pairwise), each pair
  tokenized as the model's tokenizer encodes a pair; rerank: `query`, `documents`, `top_n`,
  `return_documents`; results best first with `index` and `relevance_score`.
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio
from fastapi import Request
from tritonclient.utils import InferenceServerException

from openai_server.translate import APIError, bad
from openai_server.triton_backend import _message, _unreachable, error_status

ENCODINGS = ("float", "base64")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def embedding_inputs(body: dict[str, Any]) -> list:
    """`input` as a list of prompts (strings or token-id lists), each checked (400 naming it)."""
    raw = body.get("input")
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad("input", "input must be a non-empty string, list of strings, list of token ids or list of such lists")
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise bad("input", f"input[{i}] is an empty string: there is nothing to embed")
        elif not _is_ids(item) or not item:
            raise bad("input", f"input[{i}] must be a non-empty string or a non-empty list of token ids")
    return raw


def _options(body: dict[str, Any]) -> dict[str, Any]:
    """dimensions and truncate_prompt_tokens, type-checked here (their limits are the model's)."""
    out = {}
    for key in ("dimensions", "truncate_prompt_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad(key, f"{key} must be an integer; got {value!r}")
        out[key] = value
    return out


def _tensors(prompt: Any, task: str, options: dict[str, Any]) -> dict[str, tuple[np.ndarray, str]]:
    tensors = {"pooling_task": (np.array([task.encode()], dtype=object), "BYTES")}
    if isinstance(prompt, str):
        tensors["text_input"] = (np.array([prompt.encode("utf-8")], dtype=object), "BYTES")
    else:
        tensors["input_ids"] = (np.array(prompt, dtype=np.int32), "INT32")
    if options.get("dimensions") is not None:
        tensors["dimensions"] = (np.array([options["dimensions"]], dtype=np.int32), "INT32")
    if options.get("truncate_prompt_tokens") is not None:
        sampling = json.dumps({"truncate_prompt_tokens": options["truncate_prompt_tokens"]})
        tensors["sampling_parameters"] = (np.array([sampling.encode()], dtype=object), "BYTES")
    return tensors


async def _pool_one(triton: Any, tensors: dict[str, tuple[np.ndarray, str]]) -> tuple[np.ndarray, int]:
    """One pooling request: (its vector, its prompt's tokens). APIError: the model's refusal."""
    inputs = []
    for name, (array, datatype) in tensors.items():
        tensor = grpcaio.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = [grpcaio.InferRequestedOutput("embedding"), grpcaio.InferRequestedOutput("num_input_tokens")]
    closing = asyncio.Event()

    async def requests():
        yield {"model_name": triton.model, "inputs": inputs, "outputs": outputs, "request_id": uuid.uuid4().hex}
        await closing.wait()

    try:
        async for result, error in triton.client.stream_infer(requests()):
            if error is not None:
                message = _message(error)
                raise APIError(error_status(message), message, code="triton_error")
            return result.as_numpy("embedding").reshape(-1), int(result.as_numpy("num_input_tokens").reshape(-1)[0])
        raise APIError(503, "Triton closed the stream before answering", code="triton_unavailable")
    except InferenceServerException as exc:
        raise _unreachable(exc, triton.url) from None
    finally:
        closing.set()


async def pool_all(triton: Any, prompts: list, task: str, options: dict[str, Any]) -> list[tuple[np.ndarray, int]]:
    """Every prompt's (vector, tokens), in order; the first refusal cancels the rest."""
    tasks = [asyncio.ensure_future(_pool_one(triton, _tensors(p, task, options))) for p in prompts]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def embeddings(triton: Any, body: dict[str, Any], model: str) -> dict[str, Any]:
    prompts = embedding_inputs(body)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad("encoding_format", f"encoding_format must be float or base64; got {encoding!r}")
    results = await pool_all(triton, prompts, "embed", _options(body))
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(vec.astype("<f4").tobytes()).decode() if encoding == "base64"
             else [float(v) for v in vec]} for i, (vec, _) in enumerate(results)]
    tokens = sum(n for _, n in results)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _texts(body: dict[str, Any], key: str) -> list[str]:
    value = body.get(key)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(t, str) and t for t in items):
        raise bad(key, f"{key} must be a non-empty string or a non-empty list of non-empty strings")
    return items


def _pairs(render: Any, firsts: list[str], seconds: list[str], key: str) -> list:
    """(text_1, text_2) pairs as the prompts sent: token ids of the tokenizer's pair encoding (a
    decoder's is the two texts' tokens one after the other), or the texts joined without a tokenizer."""
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise bad(key, f"{key}: got {len(seconds)} texts for {len(firsts)} queries (give one query, or as many)")
    tokenizer = getattr(render, "tokenizer", None)
    if tokenizer is None:
        return [a + b for a, b in zip(firsts, seconds)]
    return [tokenizer.backend.encode(a, b).ids for a, b in zip(firsts, seconds)]


async def score(triton: Any, render: Any, body: dict[str, Any], model: str) -> dict[str, Any]:
    prompts = _pairs(render, _texts(body, "text_1"), _texts(body, "text_2"), "text_2")
    results = await pool_all(triton, prompts, "classify", _options(body))
    tokens = sum(n for _, n in results)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": float(vec[0])} for i, (vec, _) in enumerate(results)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def rerank(triton: Any, render: Any, body: dict[str, Any], model: str) -> dict[str, Any]:
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad("query", "query must be a non-empty string")
    documents = _texts(body, "documents")
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise bad("top_n", f"top_n must be an integer >= 1; got {top_n!r}")
    results = await pool_all(triton, _pairs(render, [query], documents, "documents"), "classify", _options(body))
    order = sorted(range(len(documents)), key=lambda i: -float(results[i][0][0]))[:top_n or len(documents)]
    keep = body.get("return_documents", True) is not False
    tokens = sum(n for _, n in results)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
            "results": [{"index": i, "relevance_score": float(results[i][0][0]),
                         **({"document": {"text": documents[i]}} if keep else {})} for i in order]}


def pooling_routes(app: Any, triton: Any, render: Any, body_of: Any) -> None:
    """The three routes; `body_of(request)`: the parsed body with its model checked."""
    @app.post("/v1/embeddings")
    async def embeddings_route(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await embeddings(triton, body, body["model"])

    @app.post("/v1/score")
    async def score_route(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        return await score(triton, render, body, body["model"])

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # vLLM serves all three
        @app.post(path)
        async def rerank_route(request: Request) -> dict[str, Any]:
            body = await body_of(request)
            return await rerank(triton, render, body, body["model"])


__all__ = ["pooling_routes", "embedding_inputs", "embeddings", "score", "rerank"]
