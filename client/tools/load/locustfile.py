"""Locust load test for the `llm` model: a gRPC streaming user and an HTTP `generate` user.

    make serve                       # in one terminal
    make load                        # headless, bounded: LOAD_USERS users for LOAD_TIME
    locust -f client/tools/load/locustfile.py --host http://localhost:8000      # web UI on :8089

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
  INFLIGHT_WORKLOAD     fixed | mixed | FILE.jsonl (default mixed; client/tools/benchmarks/workloads.py)
  INFLIGHT_MAX_TOKENS   cap on each request's output length (default 64, to keep runs short)
  INFLIGHT_USERS        which users run: grpc, http or both (default both)
"""
from __future__ import annotations

import itertools
import os
import time

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpc must yield to gevent, or one stream would block every user

from locust import HttpUser, User, between, events, task  # noqa: E402

from client.tools.load.locust_common import (close_grpc_client, finish_reason, grpc_client, http_body,  # noqa: E402
                                  open_grpc_client)
from client.tools.benchmarks.workloads import make_workload  # noqa: E402

MAX_TOKENS = int(os.environ.get("INFLIGHT_MAX_TOKENS", "64"))
WORKLOAD = make_workload(os.environ.get("INFLIGHT_WORKLOAD", "mixed"), 256, seed=0, max_output_len=MAX_TOKENS)
_next_item = itertools.count()
_WHICH = os.environ.get("INFLIGHT_USERS", "both")


def next_item():
    return WORKLOAD[next(_next_item) % len(WORKLOAD)]


class GrpcStreamUser(User):
    """Streams one request at a time over gRPC; TTFT and inter-token latency as custom events."""
    wait_time = between(0.0, 0.2)
    weight = 3

    def on_start(self) -> None:
        self._key = open_grpc_client(self.host)

    def on_stop(self) -> None:
        close_grpc_client(self._key)

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
            for chunk in grpc_client(self._key).stream(item.prompt, stream=True, max_tokens=item.max_tokens,
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
        body = http_body(item, stream=False)
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
            reason = finish_reason(data)
            if "error" in data or not reason or reason in ("abort", "error"):
                r.failure(f"bad answer: {str(data)[:200]}")
            else:
                r.success()


if _WHICH == "grpc":
    HttpGenerateUser.abstract = True
elif _WHICH == "http":
    GrpcStreamUser.abstract = True


@events.quitting.add_listener
def _fail_on_errors(environment, **_kw) -> None:
    """Exit non-zero on any failed request (also when Locust's own default would not)."""
    if environment.stats.total.num_failures > 0:
        environment.process_exit_code = 1
