"""What the Locust files share: the gRPC address from Locust's --host, the body of Triton's HTTP
generate endpoints, the users' gRPC clients, and one streamed request timed as `inflight bench`
times it (a measure.py Record) and reported as Locust request events.

Every gRPC client is registered here and closed when the test stops (and again when Locust quits),
while gevent's hub still runs: a channel left for the interpreter's exit to collect hung the Locust
process there, about 1 run in 10. Import this after `grpc.experimental.gevent.init_gevent()`.
"""
from __future__ import annotations

import gc
import itertools
import os
import time
from urllib.parse import urlparse

from locust import events

from client.tools.benchmarks.measure import Record

_GRPC_CLIENTS: dict[int, object] = {}  # the only references to them, so that closing frees them
_keys = itertools.count()


def grpc_url(host: str | None) -> str:
    """INFLIGHT_GRPC_URL, else Locust's --host with Triton's gRPC port 8001."""
    if os.environ.get("INFLIGHT_GRPC_URL"):
        return os.environ["INFLIGHT_GRPC_URL"]
    hostname = urlparse(host).hostname if host and "://" in host else (host or "").split(":")[0]
    return f"{hostname or 'localhost'}:8001"


def http_body(item, stream: bool) -> dict:
    """The JSON body of Triton's generate endpoints for one workload item (greedy, no prompt echo)."""
    body = {"max_tokens": item.max_tokens, "temperature": 0.0, "ignore_eos": item.ignore_eos,
            "exclude_input_in_output": True, "stream": stream,
            # what the users read: the model sends these outputs only when asked (vLLM backend contract)
            "return_finish_reason": True, "return_num_output_tokens": True}
    body["text_input" if isinstance(item.prompt, str) else "input_ids"] = item.prompt
    return body


def json_answer(response):
    """A catch_response answer's JSON, or None after marking it failed (an HTTP error, not JSON)."""
    if response.status_code != 200:
        response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
        return None
    try:
        return response.json()
    except ValueError:
        response.failure(f"not JSON: {response.text[:200]}")
        return None


def finish_reason(data: dict):
    """The finish reason of an HTTP generate answer or stream event: None while running (the model
    writes "None" then, as the vLLM backend does)."""
    reason = data.get("finish_reason")
    reason = reason[0] if isinstance(reason, list) and reason else reason
    return None if reason in (None, "", "None") else reason


def open_grpc_client(host: str | None, **kwargs) -> int:
    """A GrpcClient for a user; returns its key for grpc_client() and close_grpc_client()."""
    from client.grpc_client import GrpcClient

    key = next(_keys)
    _GRPC_CLIENTS[key] = GrpcClient(grpc_url(host), **kwargs)
    return key


def grpc_client(key: int):
    return _GRPC_CLIENTS[key]


def close_grpc_client(key: int) -> None:
    client = _GRPC_CLIENTS.pop(key, None)
    if client is not None:
        try:
            client.close()
        except Exception:
            pass


@events.test_stop.add_listener
def close_grpc_clients(**_kw) -> None:
    for key in list(_GRPC_CLIENTS):
        close_grpc_client(key)
    gc.collect()


@events.quitting.add_listener
def _close_at_quit(**_kw) -> None:
    close_grpc_clients()


def stream_record(client, item) -> Record:
    """One request streamed over gRPC (a GrpcClient), timed per response as the bench times it. A
    server error, or a stream that ends without a finish reason or with abort/error, is the
    record's `error`."""
    rec = Record(item, start=time.monotonic())
    try:
        for chunk in client.stream(item.prompt, stream=True, max_tokens=item.max_tokens, temperature=0.0,
                                   ignore_eos=item.ignore_eos, exclude_input_in_output=True):
            n = len(chunk.token_ids)
            if n:
                rec.chunks.append((chunk.time, n))
                rec.num_output_tokens += n
            rec.finish_reason = chunk.finish_reason or rec.finish_reason
        if rec.finish_reason is None:
            raise RuntimeError("the stream ended without a finish reason")
        if rec.finish_reason in ("abort", "error"):
            raise RuntimeError(f"finish_reason={rec.finish_reason}")
        rec.end = time.monotonic()
    except Exception as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def fire_record(environment, rec: Record) -> None:
    """A record as Locust request events of type "grpc": `time_to_first_token`, `inter_token_latency`
    (each gap between two responses, once per token) and `generate_stream` (the whole request,
    length = output tokens; failed when the record has an error)."""
    def fire(name: str, seconds: float, length: int = 0, exception=None) -> None:
        environment.events.request.fire(request_type="grpc", name=name, response_time=seconds * 1000,
                                        response_length=length, exception=exception, context={})

    if rec.chunks:
        fire("time_to_first_token", rec.chunks[0][0] - rec.start)
    if rec.error is not None:
        fire("generate_stream", time.monotonic() - rec.start, rec.num_output_tokens, RuntimeError(rec.error))
        return
    for (t0, _), (t1, n) in zip(rec.chunks, rec.chunks[1:]):
        for _ in range(n):
            fire("inter_token_latency", (t1 - t0) / n)
    fire("generate_stream", rec.end - rec.start, rec.num_output_tokens)
