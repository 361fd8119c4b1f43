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

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpc must yield to gevent, or one stream would block every user

from locust import HttpUser, User, between, events, task  # noqa: E402

from client.tools.load.locust_common import (close_grpc_client, finish_reason, fire_record, grpc_client,  # noqa: E402
                                             http_body, json_answer, open_grpc_client, stream_record)
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

    @task
    def generate_stream(self) -> None:
        fire_record(self.environment, stream_record(grpc_client(self._key), next_item()))


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
            data = json_answer(r)
            if data is None:
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
