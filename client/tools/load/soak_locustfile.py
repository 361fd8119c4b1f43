"""Locust users for the soak test (`make soak`, client/tools/load/soak.py): mixed lengths, some requests
cancelled at random, and an exact count of what happened to every request.

client/tools/load/soak.py starts the server and runs this file headless; it can also be run by hand against a
running server (`locust -f client/tools/load/soak_locustfile.py --headless -u 16 -r 16 -t 2m --host
http://localhost:8000`). Three users, so that every way a client can end a request is exercised:

- `SoakGrpcUser` (weight 2): streams over gRPC; a cancelled one leaves the stream part-way (the
  server sees the stream cancelled).
- `SoakHttpUser`: Triton's HTTP `generate` with its own request id; a cancelled one is stopped by a
  second request with the same id and `stop: true` (the only way to cancel an HTTP generate).
- `SoakHttpStreamUser`: HTTP `generate_stream`; a cancelled one closes the connection part-way.

Each request ends in exactly one of: completed (finish_reason stop/length), cancelled (we cancelled
it), rejected (the server refused it at arrival with "queue full"), failed (anything else: an error
response, a missing finish reason, a timeout, an abort we did not ask for). The counts, with the
first few failure messages, are written as JSON to INFLIGHT_SOAK_REPORT when Locust quits.

Settings (environment): INFLIGHT_GRPC_URL (gRPC host:port), INFLIGHT_SOAK_REPORT (where the counts
go), INFLIGHT_SOAK_CANCEL (share of requests cancelled, default 0.1), INFLIGHT_MAX_TOKENS (cap on
each request's output, default 64), INFLIGHT_SOAK_TIMEOUT (seconds one request may take, default 120),
INFLIGHT_SOAK_SEED (default 0).
"""
from __future__ import annotations

import itertools
import json
import os
import random
import time
import uuid

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpc must yield to gevent, or one stream would block every user

import gevent  # noqa: E402
from locust import HttpUser, User, between, events, task  # noqa: E402

from client.tools.load.locust_common import (close_grpc_client, finish_reason, grpc_client, http_body,  # noqa: E402
                                  open_grpc_client)
from client.tools.benchmarks.workloads import make_workload  # noqa: E402

MAX_TOKENS = int(os.environ.get("INFLIGHT_MAX_TOKENS", "64"))
CANCEL = float(os.environ.get("INFLIGHT_SOAK_CANCEL", "0.1"))
TIMEOUT = float(os.environ.get("INFLIGHT_SOAK_TIMEOUT", "120"))
SEED = int(os.environ.get("INFLIGHT_SOAK_SEED", "0"))
# Mixed lengths (docs/design.md's `mixed` workload): half token-id prompts, half text prompts.
WORKLOAD = (make_workload("mixed", 256, seed=SEED, max_output_len=MAX_TOKENS)
            + make_workload("mixed", 256, seed=SEED + 1, max_output_len=MAX_TOKENS, prompt_format="text"))
_items = itertools.count()
_rng = random.Random(SEED)

OUTCOMES = ("completed", "cancelled", "rejected", "failed")
COUNTS = {"sent": 0, **{k: 0 for k in OUTCOMES}, "in_flight": 0, "stop_missed": 0,
          "output_tokens": 0, "by_user": {}}
FAILURES: list[str] = []
LIVE: dict[int, "Tracker"] = {}  # requests sent and not yet ended
INTERRUPTED: list[str] = []


def tracked(task):
    """A task whose request, if Locust itself ends it (a GreenletExit or StopUser when it stops its
    users), is recorded as interrupted at quit, with the exception, rather than lost."""
    import functools

    @functools.wraps(task)
    def run(self):
        try:
            return task(self)
        except BaseException as exc:
            for t in list(LIVE.values()):
                if t.user is self:
                    t.interrupted(exc)
            raise
    return run


def next_item():
    return WORKLOAD[next(_items) % len(WORKLOAD)]


def is_rejection(message: str) -> bool:
    return "queue full" in message


class Tracker:
    """One request's life: counted as sent at once, then as exactly one outcome."""

    def __init__(self, user: User, name: str):
        self.user, self.name = user, name
        self.start = time.monotonic()
        self.outcome = None
        self.tokens = 0
        COUNTS["sent"] += 1
        COUNTS["in_flight"] += 1
        LIVE[id(self)] = self
        COUNTS["by_user"].setdefault(name, {"sent": 0, **{k: 0 for k in OUTCOMES}})["sent"] += 1

    def end(self, outcome: str, message: str = "") -> None:
        assert self.outcome is None, "a request ended twice"
        self.outcome = outcome
        LIVE.pop(id(self), None)
        COUNTS[outcome] += 1
        COUNTS["in_flight"] -= 1
        COUNTS["output_tokens"] += self.tokens
        COUNTS["by_user"][self.name][outcome] += 1
        if outcome == "failed" and len(FAILURES) < 20:
            FAILURES.append(f"{self.name}: {message}"[:500])
        # Locust's own statistics: only real failures are failures.
        exc = RuntimeError(message) if outcome == "failed" else None
        self.user.environment.events.request.fire(
            request_type="soak", name=f"{self.name} {outcome}",
            response_time=(time.monotonic() - self.start) * 1000, response_length=self.tokens,
            exception=exc, context={})

    def interrupted(self, exc: BaseException) -> None:
        """Locust ended the task mid-request (when stopping its users): the client side cut it off,
        which cancels it on the server."""
        COUNTS["interrupted_at_quit"] = COUNTS.get("interrupted_at_quit", 0) + 1
        INTERRUPTED.append(f"{self.name}: {type(exc).__name__} after {time.monotonic() - self.start:.1f}s, "
                           f"{self.tokens} tokens")
        self.end("cancelled")

    def refused(self, message: str) -> None:
        """An error answer: a refusal the soak expects (queue full, bad input) or a real failure."""
        self.end("rejected" if is_rejection(message) else "failed", message)

    def stream_ended(self, reason, cancel_after) -> None:
        """A stream that stopped with `reason`, or with none because we left it (cancel_after)."""
        if reason is None and cancel_after is not None:
            self.end("cancelled")
        else:
            self.finished(reason)

    def finished(self, reason, cancelled_by_us: bool = False) -> None:
        if reason in ("stop", "length"):
            self.end("completed")
        elif reason == "abort" and cancelled_by_us:
            self.end("cancelled")
        else:
            self.end("failed", f"finish_reason={reason!r}")


class SoakGrpcUser(User):
    """gRPC streams; a cancelled one is left part-way, which cancels it on the server."""
    wait_time = between(0.0, 0.1)
    weight = 2

    def on_start(self) -> None:
        self._key = open_grpc_client(self.host, timeout=TIMEOUT)

    def on_stop(self) -> None:
        close_grpc_client(self._key)

    @task
    @tracked
    def stream(self) -> None:
        from client.protocol import GenerationError

        item = next_item()
        cancel_after = _rng.randint(1, max(1, item.max_tokens - 1)) if _rng.random() < CANCEL else None
        track = Tracker(self, "grpc stream")
        reason = None
        try:
            for chunk in grpc_client(self._key).stream(item.prompt, stream=True, max_tokens=item.max_tokens,
                                            temperature=0.0, ignore_eos=item.ignore_eos,
                                            exclude_input_in_output=True,
                                            request_id=uuid.uuid4().hex):
                track.tokens += len(chunk.token_ids)
                reason = chunk.finish_reason or reason
                if cancel_after is not None and track.tokens >= cancel_after and reason is None:
                    break  # leaving the stream cancels the request on the server
        except GenerationError as exc:
            track.refused(str(exc))
            return
        except Exception as exc:
            track.end("failed", f"{type(exc).__name__}: {exc}")
            return
        track.stream_ended(reason, cancel_after)


class SoakHttpUser(HttpUser):
    """HTTP generate with a request id; a cancelled one is stopped by id from a second greenlet."""
    wait_time = between(0.0, 0.1)
    weight = 1

    @task
    @tracked
    def generate(self) -> None:
        item = next_item()
        rid = f"soak-{uuid.uuid4().hex}"
        body = {"id": rid, **http_body(item, stream=False)}
        stopper = None
        stopped = {"sent": False, "ok": False}
        if _rng.random() < CANCEL:
            stopper = gevent.spawn(self._stop_later, rid, _rng.uniform(0.05, 1.0), stopped)
        track = Tracker(self, "http generate")
        try:
            r = self.client.request("POST", "/v2/models/llm/generate", json=body, timeout=TIMEOUT,
                                    name="generate", catch_response=True)
            with r:
                r.success()  # outcomes are counted by the tracker, not by Locust's default rules
                data = _json(r.text)
                if r.status_code != 200 or "error" in data:
                    message = str(data.get("error", r.text))[:300]
                    if stopper is not None:
                        stopper.kill()
                    track.refused(f"HTTP {r.status_code}: {message}")
                    return
                reason = finish_reason(data)
                track.tokens = int(_first(data.get("num_output_tokens")) or 0)  # one answer: all of them
        except Exception as exc:
            track.end("failed", f"{type(exc).__name__}: {exc}")
            return
        if stopper is not None:
            stopper.join(timeout=TIMEOUT)
        track.finished(reason, cancelled_by_us=stopped["ok"])

    def _stop_later(self, rid: str, delay: float, stopped: dict) -> None:
        gevent.sleep(delay)
        stopped["sent"] = True
        r = self.client.request("POST", "/v2/models/llm/generate", json={"id": rid, "stop": True, "return_finish_reason": True},
                                timeout=TIMEOUT, name="stop", catch_response=True)
        with r:
            r.success()
            if r.status_code == 200 and finish_reason(_json(r.text)) == "abort":
                stopped["ok"] = True
            else:  # it had finished (or not yet arrived): it completes on its own
                COUNTS["stop_missed"] += 1


class SoakHttpStreamUser(HttpUser):
    """HTTP generate_stream; a cancelled one closes the connection part-way."""
    wait_time = between(0.0, 0.1)
    weight = 1

    @task
    @tracked
    def generate_stream(self) -> None:
        item = next_item()
        body = http_body(item, stream=True)
        cancel_after = _rng.randint(1, max(1, item.max_tokens - 1)) if _rng.random() < CANCEL else None
        track = Tracker(self, "http stream")
        reason = None
        try:
            with self.client.request("POST", "/v2/models/llm/generate_stream", json=body, stream=True,
                                     timeout=TIMEOUT, name="generate_stream", catch_response=True) as r:
                r.success()
                for line in r.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    event = _json(line[5:].decode("utf-8", "replace"))
                    if "error" in event:
                        track.refused(str(event["error"]))
                        return
                    ids = event.get("output_ids", [])
                    track.tokens += len(ids) if isinstance(ids, list) else 1
                    reason = finish_reason(event) or reason
                    if reason:
                        break
                    if cancel_after is not None and track.tokens >= cancel_after:
                        break
                r.close()  # part-way, closing the connection cancels the request on the server
                if reason is None and cancel_after is None and r.status_code != 200:
                    track.end("failed", f"HTTP {r.status_code}: {r.text[:300]}")
                    return
        except Exception as exc:
            track.end("failed", f"{type(exc).__name__}: {exc}")
            return
        track.stream_ended(reason, cancel_after)


def _json(text: str) -> dict:
    try:
        data = json.loads(text)
    except ValueError:
        return {"error": f"not JSON: {text[:200]}"}
    return data if isinstance(data, dict) else {"error": f"not a JSON object: {text[:200]}"}


def _first(value):
    return value[0] if isinstance(value, list) and value else value


@events.quitting.add_listener
def _write_report(environment, **_kw) -> None:
    path = os.environ.get("INFLIGHT_SOAK_REPORT")
    if path:
        now = time.monotonic()
        live = [f"{t.name}: {now - t.start:.1f}s, {t.tokens} tokens" for t in LIVE.values()]
        with open(path, "w") as f:
            json.dump({**COUNTS, "failures": FAILURES, "live_at_quit": live, "interrupted": INTERRUPTED},
                      f, indent=1)
