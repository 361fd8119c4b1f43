"""The FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (on the chat
path: responses_api.py), /tokenize, /detokenize (tokenize_api.py), /health, /metrics; with runtime
LoRA on, /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_api.py).

Each call becomes one Triton request per choice (prompts x n), sent on the shared gRPC channel and
read as they stream back; their pieces are merged into one SSE stream (`stream: true`) or one body.
A client that goes away cancels its Triton requests: leaving the SSE generator (Starlette cancels
it on disconnect) or the disconnect watcher of a non-streaming call cancels the tasks, whose gRPC
streams are then cancelled (triton.py).

What costs CPU in proportion to a body never runs on the event loop (issue 46: four chats of 200k
messages held a trivial completion 27 s): a large body is parsed and checked, and a chat rendered
by its template and tokenized, on a small thread pool; a chat of more than `max_chat_messages`
messages, or whose rendered prompt passes `max_chat_rendered_chars` characters, is a 400 naming
the limit (`python -m openai_server --max-chat-messages N --max-chat-rendered-chars N`).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from backend.core.errors import retry_after_of
from openai_server.media import ImageParts, MediaPolicy
from openai_server.auth import APIKeyMiddleware
from openai_server.chat_render import DEFAULT_MAX_CHAT_RENDERED_CHARS, ChatRenderer
from openai_server.echo_logprobs import echo_logprobs, prompt_ids
from openai_server.lora_api import add_lora_routes, runtime_lora_enabled
from openai_server.metrics import GatewayMetrics, default_metrics_url
from openai_server.pooling_api import pooling_routes
from openai_server.reasoning_request import parse_chat_request
from openai_server.request_body import parse_body, read_body
from openai_server.responses import ChoiceState, Reply, sse
from openai_server.responses_api import Answer, events as response_events, to_chat
from openai_server.tokenize_api import MaxModelLen, detokenize, tokenize
from openai_server.translate import APIError, Generation, bad, parse_completion, triton_tensors
from openai_server.triton_backend import TritonBackend

DEFAULT_MAX_CHAT_MESSAGES = 10_000
OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed on the pool, not the event loop
PREPARE_THREADS = 2  # each holds the GIL part of the time: fewer leave more of it to the event loop


def _error(exc: APIError) -> JSONResponse:
    # An overload refusal (queue full, a time-to-first-token target the queue cannot meet) says when
    # to retry: its message ends "retry after N s" (backend/core/errors.py), sent as Retry-After.
    wait = retry_after_of(exc.message) if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers={"Retry-After": str(wait)} if wait else None)


def create_app(grpc_url: str, model_path: Optional[str] = None, served_model_name: str = "llm",
               tool_call_parser: str = "hermes", metrics_url: Optional[str] = None,
               reasoning_parser: Optional[str] = None, max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES,
               max_chat_rendered_chars: int = DEFAULT_MAX_CHAT_RENDERED_CHARS, api_keys: tuple[str, ...] = (),
               api_key_all_routes: bool = False, runtime_lora: bool = False,
               media_policy: Optional[MediaPolicy] = None) -> FastAPI:
    triton = TritonBackend(grpc_url)
    gateway = GatewayMetrics(metrics_url or default_metrics_url(grpc_url), triton.model, served_model_name)
    render = ChatRenderer(model_path, max_chat_rendered_chars)
    image_parts = ImageParts(model_path, render.tokenizer, media_policy)  # image_url parts (media.py)
    pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="openai-prepare")

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the pool: the event loop serves other calls meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await triton.close()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="inflight OpenAI-compatible API", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.triton = triton
    if api_keys:  # Authorization: Bearer on /v1, /tokenize, /detokenize (auth.py)
        app.add_middleware(APIKeyMiddleware, keys=api_keys, all_routes=api_key_all_routes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    # The door's backstop: what a hostile body makes Python raise past the checks that name the
    # field (backend/core/input_guard.py) is still the client's fault, never a 500.
    @app.exception_handler(RecursionError)
    @app.exception_handler(OverflowError)
    @app.exception_handler(UnicodeError)
    async def _hostile_input(request: Request, exc: Exception) -> JSONResponse:
        return _error(APIError(400, f"the request cannot be read: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = await triton.ready()
        return JSONResponse({"status": "ok" if ok else "triton model not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics")  # the inference gateway's model-server protocol (openai_server/metrics.py)
    async def metrics():
        return await gateway.response()

    def _card(name: str, adapters: dict[str, str]) -> dict[str, Any]:
        """A model of /v1/models: the base, or a LoRA adapter and its parent (vLLM's card, with names
        where vLLM writes folders: a client has no use for the server's paths)."""
        if name in adapters:
            return {"id": name, "object": "model", "created": 0, "owned_by": "inflight", "root": name,
                    "parent": served_model_name}
        return {"id": served_model_name, "object": "model", "created": 0, "owned_by": "inflight",
                "root": served_model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = await triton.lora_adapters(refresh=True)  # an adapter named like the base model is refused at load
        return {"object": "list", "data": [_card(n, adapters) for n in
                                           [served_model_name, *(a for a in adapters if a != served_model_name)]]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        return _card(await _check_model(name), await triton.lora_adapters())

    async def _check_model(name: Any) -> str:
        """The model a request names: the served model or one of its LoRA adapters (docs/lora.md)."""
        if name is None:
            raise bad("model", "model is required")
        adapters = await triton.lora_adapters()
        if name != served_model_name and name not in adapters:  # loaded since (at run time, either door)?
            adapters = await triton.lora_adapters(refresh=True)
        if name != served_model_name and name not in adapters:
            also = f" and its LoRA adapters {', '.join(repr(a) for a in adapters)}" if adapters else ""
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{served_model_name}'{also}", "model", "model_not_found")
        return name

    async def _body(request: Request, model_required: bool = True) -> dict[str, Any]:
        raw = await read_body(request)
        body = await off_loop(parse_body, raw) if len(raw) > OFF_LOOP_BYTES else parse_body(raw)
        if model_required or body.get("model") is not None:
            await _check_model(body.get("model"))
        return body

    def _check_messages(body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > max_chat_messages:
            raise bad("messages", f"messages has {len(messages)} entries; the limit is {max_chat_messages} "
                                  "(--max-chat-messages)")
        return body

    if runtime_lora_enabled(runtime_lora):  # /v1/load_lora_adapter, /v1/unload_lora_adapter (lora_api.py)
        add_lora_routes(app, triton, served_model_name, functools.partial(_body, model_required=False))

    max_model_len = MaxModelLen(triton, model_path)
    pooling_routes(app, triton, render, _body)  # /v1/embeddings, /v1/score, /v1/rerank (pooling_api.py)

    @app.post("/tokenize")  # vLLM's (tokenize_api.py); model may be left out
    async def tokenize_route(request: Request) -> dict[str, Any]:
        body = _check_messages(await _body(request, model_required=False))
        return await off_loop(tokenize, body, render, tool_call_parser, reasoning_parser, await max_model_len())

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return await off_loop(detokenize, await _body(request, model_required=False), render)

    def _with_adapter(gen: Generation, body: dict[str, Any]) -> Generation:
        """`model` naming a LoRA adapter runs the base model with it (lora_name, the vLLM backend's key)."""
        if body["model"] != served_model_name:
            gen.sampling["lora_name"] = body["model"]
        return gen

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        gen = _with_adapter(parse_completion(body), body)
        return await _answer(request, gen, Reply(f"cmpl-{gen.request_id}", body["model"], chat=False))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _chat(request, await _body(request))

    @app.post("/v1/responses")  # stateless, on the chat path (responses_api.py)
    async def responses(request: Request):
        body = await _body(request)
        answer = Answer(body, lambda text: len(render.tokenizer.encode(text, add_special_tokens=False)))
        reply = await _chat(request, await off_loop(to_chat, body))
        if isinstance(reply, StreamingResponse):
            return StreamingResponse(response_events(reply.body_iterator, answer), media_type="text/event-stream")
        if reply.status_code != 200:  # the client left (499)
            return reply
        return JSONResponse(answer.from_chat(json.loads(reply.body)))

    async def _chat(request: Request, body: dict[str, Any]):
        body = _check_messages(body)
        body, images = await off_loop(image_parts.extract, body)  # fetched and checked off the loop
        gen, thinking = await off_loop(parse_chat_request, body, render, tool_call_parser,  # reasoning_request.py
                                       reasoning_parser)
        gen.images = images
        gen = _with_adapter(gen, body)
        return await _answer(request, gen, Reply(f"chatcmpl-{gen.request_id}", body["model"], chat=True,
                                                 tools=gen.tools, thinking=thinking))

    async def _answer(request: Request, gen: Generation, reply: Reply):
        declared = await triton.declared_inputs()
        tensors = [triton_tensors(gen, i, declared) for i in range(len(gen.prompts))]
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_run(i * gen.n, t, gen.logprobs, queue)) for i, t in enumerate(tensors)]
        try:
            if gen.stream:
                # The headers wait for the first piece, so that a refusal before any token is
                # answered with its status; a client that leaves meanwhile (its request still
                # queued) cancels it, as one that leaves mid-stream does.
                watcher = asyncio.create_task(_watch_disconnect(request))
                try:
                    first = await _next_or_gone(queue, watcher)
                finally:
                    watcher.cancel()
                if first is None:
                    _cancel(tasks)
                    return JSONResponse({}, status_code=499)
                if isinstance(first[1], APIError):
                    raise first[1]
                return StreamingResponse(_sse(gen, reply, tasks, queue, first),
                                         media_type="text/event-stream")
            return await _whole(request, gen, reply, tasks, queue)
        except BaseException:
            _cancel(tasks)
            raise

    async def _run(first_choice: int, tensors, top_k: Optional[int], queue: asyncio.Queue) -> None:
        """One prompt's Triton request: (choice index, Piece) per completion per response."""
        index = first_choice
        try:
            async for got in triton.generate(tensors, top_k):
                for offset, piece in enumerate(got):
                    await queue.put((first_choice + offset, piece))
        except APIError as exc:
            await queue.put((index, exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must still end the call, not hang it
            await queue.put((index, APIError(500, f"{type(exc).__name__}: {exc}")))

    async def _whole(request: Request, gen: Generation, reply: Reply, tasks, queue) -> JSONResponse:
        states = [ChoiceState() for _ in range(gen.num_choices)]
        watcher = asyncio.create_task(_watch_disconnect(request))
        try:
            remaining = gen.num_choices
            while remaining:
                got = await _next_or_gone(queue, watcher)
                if got is None:  # the client left: stop generating for it
                    _cancel(tasks)
                    return JSONResponse({}, status_code=499)
                index, item = got
                if isinstance(item, APIError):
                    raise item
                remaining -= states[index].add(item)
        finally:
            watcher.cancel()
        prefixes = _echo_prefixes(gen, render) if gen.echo else None
        echoed = _echoed(gen, states) if gen.echo and gen.logprobs is not None else None
        return JSONResponse(reply.body(states, gen.n, gen.logprobs is not None, prefixes, echoed))

    async def _sse(gen: Generation, reply: Reply, tasks, queue, first) -> AsyncIterator[bytes]:
        states = [ChoiceState() for _ in range(gen.num_choices)]
        started = [False] * gen.num_choices
        prefixes = _echo_prefixes(gen, render) if gen.echo else None
        echoed: dict[int, list] = {}
        remaining, item = gen.num_choices, first
        try:
            while True:
                index, piece = item
                if isinstance(piece, APIError):  # after the headers went out: an error event
                    yield sse(piece.body())
                    break
                if states[index].finish_reason is not None:
                    item = await queue.get()  # a finished completion's reason, repeated (n > 1)
                    continue
                ended = states[index].add(piece)
                if piece.text or ended or piece.logprobs or not started[index] or piece.queue_info is not None:
                    if gen.echo and gen.logprobs is not None and index not in echoed:  # once, at its first chunk
                        echoed[index] = _echoed(gen, states, [index])[0]
                    yield sse(reply.chunk(index, piece, states[index], not started[index],
                                          gen.logprobs is not None, gen.include_usage,
                                          prefixes[index] if prefixes else "", echoed.get(index)))
                    started[index] = True
                remaining -= ended
                if not remaining:
                    if gen.include_usage:
                        yield sse(reply.usage_chunk(states, gen.n))
                    break
                item = await queue.get()
            yield sse("[DONE]")
        finally:  # also on disconnect: Starlette cancels this generator
            _cancel(tasks)

    def _echoed(gen: Generation, states: list[ChoiceState], which: Optional[list[int]] = None) -> list[list]:
        """echo with logprobs: the choices' (all, or `which`) prompt tokens and their logprobs
        (echo_logprobs.py)."""
        tok = render.tokenizer
        decode = (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str
        return [echo_logprobs(prompt_ids(gen.prompts[i // gen.n], tok), states[i].prompt_logprobs, gen.logprobs,
                              decode) for i in (range(len(states)) if which is None else which)]

    return app


def _echo_prefixes(gen: Generation, render: ChatRenderer) -> list[str]:
    """echo: each choice starts with its prompt (token-id prompts are decoded)."""
    out = []
    for i in range(gen.num_choices):
        prompt = gen.prompts[i // gen.n]
        if isinstance(prompt, str):
            out.append(prompt)
        elif render.tokenizer is not None:
            out.append(render.tokenizer.decode(prompt, skip_special_tokens=False))
        else:
            raise bad("echo", "echo of a token-id prompt needs --model-path (the tokenizer)")
    return out


def _cancel(tasks) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()


async def _next_or_gone(queue: asyncio.Queue, watcher: asyncio.Task):
    """The queue's next item, or None once `watcher` (_watch_disconnect) saw the client leave."""
    getter = asyncio.create_task(queue.get())
    done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    return None


async def _watch_disconnect(request: Request, interval: float = 0.2) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(interval)


__all__ = ["create_app", "ChatRenderer"]
