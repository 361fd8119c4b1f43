"""vLLM's routes for LoRA adapters at run time: POST /v1/load_lora_adapter
(`{"lora_name", "lora_path"}`) and POST /v1/unload_lora_adapter (`{"lora_name"}`, `lora_int_id`
accepted as vLLM's body has it). Each becomes one control request to the Triton model
(model_repository/llm/1/lora_control.py), whose engine loads or drains the adapter: the doors
share one engine, so what is loaded here is a `lora_name` on Triton's own door too.

Off unless `--enable-runtime-lora` or vLLM's environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING
(true / 1) is set: then the routes do not exist (404 Not Found, as vLLM answers). The model must
allow it as well (its config key enable_runtime_lora; `inflight serve --enable-runtime-lora` sets
both). Answers as vLLM's: 200 with a plain-text success line; 400 naming why a load is refused
(bad or missing files, a rank or module that does not fit, a pickle, a taken name, max_cpu_loras);
404 for an adapter that is not loaded. An unload answers once the adapter's running requests have
finished; requests naming it are refused (404) from its start.
"""
from __future__ import annotations

import os
from typing import Any, Awaitable, Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from backend.core.defaults import RUNTIME_LORA_ENV
from backend.core.lora import check_adapter_name
from openai_server.translate import APIError

_TRUE = ("1", "true", "yes", "on")


def runtime_lora_enabled(flag: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """The flag, or vLLM's environment variable set to a true value."""
    return bool(flag) or environ.get(RUNTIME_LORA_ENV, "").strip().lower() in _TRUE


def _name(body: dict[str, Any], what: str) -> Any:
    name = body.get("lora_name")
    if name is not None and not isinstance(name, str):
        raise APIError(400, f"{what}: lora_name must be a string; got {type(name).__name__}", "lora_name")
    return name


def add_lora_routes(app: FastAPI, triton: Any, served_model_name: str,
                    read_json: Callable[[Request], Awaitable[dict[str, Any]]]) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json(request)
        name, path = _name(body, "load_lora_adapter"), body.get("lora_path")
        if not name or not isinstance(path, str) or not path:
            raise APIError(400, "load_lora_adapter needs both lora_name and lora_path (strings)",
                           "lora_path" if name else "lora_name")
        try:  # the name clients give the base model here may differ from the model's config
            check_adapter_name(name, "lora_name", served_model_name)
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_name") from None
        try:  # lora_int_id, if sent, is vLLM's and unused: names identify adapters here
            answer = await triton.lora_control({"lora_action": "load", "lora_name": name, "lora_path": path})
        finally:
            await triton.lora_adapters(refresh=True)
        return PlainTextResponse(answer["message"])

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json(request)
        name, number = _name(body, "unload_lora_adapter"), body.get("lora_int_id")
        if not name and number is None:
            raise APIError(400, "unload_lora_adapter needs lora_name (or lora_int_id)", "lora_name")
        if number is not None and (not isinstance(number, int) or isinstance(number, bool)):
            raise APIError(400, f"unload_lora_adapter: lora_int_id must be an integer; got {number!r}", "lora_int_id")
        control = {"lora_action": "unload", **({"lora_name": name} if name else {}),
                   **({"lora_int_id": number} if number is not None else {})}
        try:
            answer = await triton.lora_control(control)
        finally:
            await triton.lora_adapters(refresh=True)
        return PlainTextResponse(answer["message"])


__all__ = ["add_lora_routes", "runtime_lora_enabled"]
