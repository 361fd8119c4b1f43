"""The OpenAI server's one connection to Triton: tritonclient's asyncio gRPC client, whose channel
every request shares (each request is its own bidirectional stream on it).

A request whose consumer stops early (the HTTP client went away) has its stream cancelled, and
Triton cancels the request: the engine aborts it and frees its KV blocks within a step.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator, Optional

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from backend.core.errors import retry_after_of
from backend.models.lora.served import configured_adapters
from openai_server.responses import Piece, pieces
from templates.tensors import QUEUE_INFO_OUTPUTS
from openai_server.translate import APIError

MODEL_NAME = "llm"
OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens",
           "num_cached_tokens", "logprobs", "cumulative_logprob", "prompt_logprobs") + QUEUE_INFO_OUTPUTS


def error_status(message: str) -> int:
    """The HTTP status of an error response from the model. Over the gRPC stream Triton sends the
    message without its code, so the adapter's wording tells them apart (triton_errors.error_for):
    an adapter that is not loaded 404; overload (a full queue, a time-to-first-token target the
    queue cannot meet: the message ends "retry after N s", app.py's Retry-After) 429; shutting down or a dead engine 503; an internal
    failure is written "<ExceptionType>: ..." 500; anything else is a refused request 400."""
    low = message.lower()
    if "is not loaded" in low:  # a LoRA adapter (docs/lora.md): an unknown model, as OpenAI and vLLM answer it
        return 404
    if "queue full" in low or retry_after_of(message) is not None:
        return 429
    if "shutting down" in low or "shut down" in low or "engine stopped" in low:
        return 503
    head = message.split(":", 1)[0]
    if head.isidentifier() and (head.endswith("Error") or head.endswith("Exception")):
        return 500
    return 400


def _unreachable(exc: Exception, url: str) -> APIError:
    return APIError(503, f"Triton is unreachable at {url} ({_message(exc)})", code="triton_unavailable")


def _message(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    return message() if callable(message) else str(exc)


class TritonBackend:
    def __init__(self, url: str, model: str = MODEL_NAME):
        self.url = url
        self.model = model
        self._client: Optional[grpcaio.InferenceServerClient] = None
        self._inputs: Optional[frozenset[str]] = None
        self._outputs: tuple[str, ...] = ()
        self._adapters: Optional[dict[str, str]] = None

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        if self._client is None:  # made on first use, inside the server's event loop
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def declared_inputs(self) -> frozenset[str]:
        """The model's input names (read once): which `return_*` switches it has."""
        if self._inputs is None:
            try:
                meta = await self.client.get_model_metadata(self.model, as_json=True)
            except InferenceServerException as exc:
                raise _unreachable(exc, self.url) from None
            self._inputs = frozenset(i["name"] for i in meta.get("inputs", []))
            self._outputs = tuple(o["name"] for o in meta.get("outputs", []) if o["name"] in OUTPUTS)
        return self._inputs

    async def lora_adapters(self, refresh: bool = False) -> dict[str, str]:
        """The LoRA adapters the engine holds now (name -> ""), as the model's `lora_action: list`
        answers (model_repository/llm/1/lora_control.py): kept until `refresh` (a load or unload
        here, /v1/models, a name not among them). A model that does not answer it: the adapters of
        its config as Triton loaded it (multi_lora.json and lora_modules, name -> folder). While Triton
        does not answer: the last list it gave (none before its first), so /v1/models still lists
        the served model."""
        if self._adapters is None or refresh:
            try:
                answer = await self.lora_control({"lora_action": "list"})
                self._adapters = dict.fromkeys(answer.get("adapters", []), "")
            except APIError as exc:
                if exc.status == 503:  # Triton not answering: what it last said, if anything
                    return self._adapters or {}
                try:
                    config = (await self.client.get_model_config(self.model, as_json=True)).get("config", {})
                except InferenceServerException:
                    return {}
                self._adapters = configured_adapters(
                    {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()})
        return self._adapters

    async def lora_control(self, parameters: dict[str, Any]) -> dict[str, Any]:
        """Send a LoRA control request (`lora_action` load / unload / list, as request parameters)
        and return its JSON answer. Raises APIError: the refusal, with its status (error_status)."""
        closing = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": [], "request_id": uuid.uuid4().hex, "parameters": parameters,
                   "outputs": [grpcaio.InferRequestedOutput("text_output")]}
            await closing.wait()

        responses = self.client.stream_infer(requests())
        try:
            async for result, error in responses:
                if error is not None:
                    message = _message(error)
                    raise APIError(error_status(message), message, code="lora_control")
                return json.loads(result.as_numpy("text_output").reshape(-1)[0])
            raise APIError(503, "Triton closed the stream before answering", code="triton_unavailable")
        except (InferenceServerException, grpc.RpcError) as exc:  # the channel: Triton is not there (yet)
            raise _unreachable(exc, self.url) from None
        finally:
            closing.set()

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model))
        except InferenceServerException:
            return False

    async def generate(self, tensors: dict[str, tuple[np.ndarray, str]],
                       top_k: Optional[int] = None) -> AsyncIterator[list[Piece]]:
        """Send one request and yield each response (a Piece per completion) until every completion
        has its finish reason. Raises
        APIError: the model's refusal (its status from the message), or Triton unreachable (503: the
        channel failed, or gRPC cut the stream, "Stream removed", as when the model's process dies).
        Leaving early cancels the request on the server."""
        await self.declared_inputs()
        inputs = []
        for name, (array, datatype) in tensors.items():
            tensor = grpcaio.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        outputs = [grpcaio.InferRequestedOutput(name) for name in self._outputs]
        request_id = uuid.uuid4().hex
        closing = asyncio.Event()
        finished: set[int] = set()  # completions that have their finish reason

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "outputs": outputs, "request_id": request_id}
            await closing.wait()  # our side stays open until the answer is complete

        responses = self.client.stream_infer(requests())
        done = False
        try:
            async for result, error in responses:
                if error is not None:
                    message = _message(error)
                    raise APIError(error_status(message), message, code="triton_error")
                got = pieces(result.as_numpy, top_k)
                finished.update(i for i, p in enumerate(got) if p.finish_reason is not None)
                done = len(finished) == len(got)
                yield got
                if done:
                    break
            if not done:
                raise APIError(503, "Triton closed the stream before the answer was complete",
                               code="triton_unavailable")
        except (InferenceServerException, grpc.RpcError) as exc:  # the channel failed, or cut the stream
            raise _unreachable(exc, self.url) from None
        finally:
            closing.set()
            if not done:
                responses.cancel()  # early exit or failure: Triton cancels the request

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
