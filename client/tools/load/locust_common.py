"""What the two Locust files share: the gRPC address from Locust's --host, the body of Triton's
HTTP generate endpoints, and the users' gRPC clients.

Every gRPC client is registered here and closed when the test stops (and again when Locust quits),
while gevent's hub still runs: a channel left for the interpreter's exit to collect hung the Locust
process there, about 1 run in 10. Import this after `grpc.experimental.gevent.init_gevent()`.
"""
from __future__ import annotations

import gc
import itertools
import os
from urllib.parse import urlparse

from locust import events

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
