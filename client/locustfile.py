"""Locust load test for the `llm` model: a gRPC streaming user and an HTTP `generate` user.

    make serve                       # in one terminal
    make load                        # headless, bounded: LOAD_USERS users for LOAD_TIME
    locust -f client/locustfile.py --host http://localhost:8000      # web UI on :8089

`GrpcStreamUser` streams over Triton's gRPC bidirectional stream (client/grpc_client.py) and reports, as
Locust request events of type "grpc":
  - `generate_stream`: the whole request (response time = end-to-end, length = output tokens);
  - `time_to_first_token`: the wait for the first token;
  - `inter_token_latency`: each gap between two streamed responses, per token.
`HttpGenerateUser` posts to Triton's HTTP `generate` endpoint (one response per request).
A request fails when the server answers with an error or does not end with a finish reason, so
`locust --headless` exits non-zero on any failed request.

Settings (environment):
  INFLIGHT_GRPC_URL     gRPC host:port (default: --host's host, port 8001)
  INFLIGHT_WORKLOAD     fixed | mixed | FILE.jsonl (default mixed; client/workloads.py)
  INFLIGHT_MAX_TOKENS   cap on each request's output length (default 64, to keep runs short)
  INFLIGHT_USERS        which users run: grpc, http or both (default both)
"""
from __future__ import annotations

import gc
import itertools
import os
import time
from urllib.parse import urlparse

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpc must yield to gevent, or one stream would block every user

from locust import HttpUser, User, between, events, task  # noqa: E402

from client.workloads import make_workload  # noqa: E402

MAX_TOKENS = int(os.environ.get("INFLIGHT_MAX_TOKENS", "64"))
WORKLOAD = make_workload(os.environ.get("INFLIGHT_WORKLOAD", "mixed"), 256, seed=0, max_output_len=MAX_TOKENS)
_next_item = itertools.count()
_WHICH = os.environ.get("INFLIGHT_USERS", "both")
# The users' gRPC clients, by key: only this dict holds them, so that they can all be closed (and
# their channels finalized) while gevent's hub still runs. A channel left for the interpreter's
# exit to collect can hang the process there (seen about 1 run in 10).
_GRPC_CLIENTS: dict[int, object] = {}
_client_keys = itertools.count()


def next_item():
    return WORKLOAD[next(_next_item) % len(WORKLOAD)]


def grpc_url(host: str | None) -> str:
    if os.environ.get("INFLIGHT_GRPC_URL"):
        return os.environ["INFLIGHT_GRPC_URL"]
    hostname = urlparse(host).hostname if host and "://" in host else (host or "").split(":")[0]
    return f"{hostname or 'localhost'}:8001"


class GrpcStreamUser(User):
    """Streams one request at a time over gRPC; TTFT and inter-token latency as custom events."""
    wait_time = between(0.0, 0.2)
    weight = 3

    def on_start(self) -> None:
        from client.grpc_client import GrpcClient
        self._key = next(_client_keys)
        _GRPC_CLIENTS[self._key] = GrpcClient(grpc_url(self.host))

    def on_stop(self) -> None:
        _close_client(self._key)

    def _fire(self, name: str, ms: float, length: int = 0, exception=None) -> None:
        self.environment.events.request.fire(request_type="grpc", name=name, response_time=ms,
                                             response_length=length, exception=exception, context={})

    @task
    def generate_stream(self) -> None:
        item = next_item()
        start = time.monotonic()
        last = None
        tokens = 0
        reason = None
        gaps: list[tuple[float, int]] = []
        try:
            for chunk in _GRPC_CLIENTS[self._key].stream(item.prompt, stream=True, max_tokens=item.max_tokens,
                                            temperature=0.0, ignore_eos=item.ignore_eos,
                                            exclude_input_in_output=True):
                n = len(chunk.token_ids)
                if n:
                    if last is None:
                        self._fire("time_to_first_token", (chunk.time - start) * 1000)
                    else:
                        gaps.append(((chunk.time - last) / n, n))
                    last = chunk.time
                    tokens += n
                reason = chunk.finish_reason or reason
            if reason is None:
                raise RuntimeError("the stream ended without a finish reason")
            if reason in ("abort", "error"):
                raise RuntimeError(f"finish_reason={reason}")
        except Exception as exc:
            self._fire("generate_stream", (time.monotonic() - start) * 1000, tokens, exc)
            return
        for gap, n in gaps:
            for _ in range(n):
                self._fire("inter_token_latency", gap * 1000)
        self._fire("generate_stream", (time.monotonic() - start) * 1000, tokens)


class HttpGenerateUser(HttpUser):
    """One request per call on Triton's HTTP generate endpoint (the model answers once)."""
    wait_time = between(0.0, 0.2)
    weight = 1

    @task
    def generate(self) -> None:
        item = next_item()
        body = {"max_tokens": item.max_tokens, "temperature": 0.0, "ignore_eos": item.ignore_eos,
                "exclude_input_in_output": True, "stream": False}
        body["text_input" if isinstance(item.prompt, str) else "input_ids"] = item.prompt
        with self.client.post("/v2/models/llm/generate", json=body, name="http generate",
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            try:
                data = r.json()
            except ValueError:
                r.failure(f"not JSON: {r.text[:200]}")
                return
            reason = data.get("finish_reason")
            reason = reason[0] if isinstance(reason, list) and reason else reason
            if "error" in data or not reason or reason in ("abort", "error"):
                r.failure(f"bad answer: {str(data)[:200]}")
            else:
                r.success()


if _WHICH == "grpc":
    HttpGenerateUser.abstract = True
elif _WHICH == "http":
    GrpcStreamUser.abstract = True


def _close_client(key: int) -> None:
    client = _GRPC_CLIENTS.pop(key, None)
    if client is not None:
        try:
            client.close()
        except Exception:
            pass


@events.test_stop.add_listener
def _close_grpc_clients(**_kw) -> None:
    for key in list(_GRPC_CLIENTS):
        _close_client(key)
    gc.collect()


@events.quitting.add_listener
def _fail_on_errors(environment, **_kw) -> None:
    """Exit non-zero on any failed request (also when Locust's own default would not)."""
    _close_grpc_clients()
    if environment.stats.total.num_failures > 0:
        environment.process_exit_code = 1
