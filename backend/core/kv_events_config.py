"""`kv_events_config` (vLLM's `--kv-events-config` keys), parsed and checked once: what the
KV-cache events' publisher (backend/kv/event_publisher.py) is told to do. No torch, no ZMQ.

Checked like every other config (issue 46): JSON nesting, numbers and their ranges (a tcp port
moved up by `data_parallel_rank` must stay a port), text that UTF-8 can carry; every refusal one
line naming the key, its value and the limit.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Optional

from backend.core.input_guard import check_text, guarded

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
HOST_ENV = "INFLIGHT_HOST"  # the server's --host, as `inflight serve` passes it to the model (bind_host)
MAX_PORT = 65535
# key -> (lowest, highest): what the publisher allocates (buffer_steps batches, hwm messages per
# subscriber, max_queue_size batches) stays within memory, and a rank keeps ports ports
RANGES = {"buffer_steps": (1, 1_000_000), "hwm": (0, 10_000_000), "max_queue_size": (1, 10_000_000),
          "data_parallel_rank": (0, 1023)}
MAX_TEXT = 1024  # characters of a topic, an address or a bind host
_TCP = re.compile(r"^tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})$")
_HOST = re.compile(r"^(\*|[0-9A-Fa-f:.]+|[A-Za-z0-9_.\-]+)$")


@dataclass(frozen=True)
class KVEventsConfig:
    """`kv_events_config`, parsed: vLLM's KVEventsConfig keys and defaults, and two of ours the
    server sets: `data_parallel_rank`, for the i-th model instance (its ports move up by i, as
    vLLM's data-parallel ranks' do, so that instances never collide), and `bind_host`, the address
    a `*` endpoint binds (`inflight serve --host`; "" or 0.0.0.0: every interface, as vLLM)."""
    enable_kv_cache_events: bool = False
    publisher: str = ""  # "zmq" | "null"; "" follows enable_kv_cache_events, as vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    data_parallel_rank: int = 0
    bind_host: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


KINDS = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": (str, type(None)),
         "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str, "data_parallel_rank": int,
         "bind_host": str}


def parse_kv_events_config(raw: str) -> Optional[KVEventsConfig]:
    """kv_events_config (JSON) -> KVEventsConfig, or None for "". ValueError names the key."""
    if not raw or not raw.strip():
        return None
    try:
        with guarded("kv_events_config"):  # 100k-deep nesting, 1e400, a lone surrogate
            data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"kv_events_config is not valid JSON: {exc}" if "kv_events_config" not in str(exc)
                         else str(exc)) from None
    if not isinstance(data, dict):
        raise ValueError("kv_events_config must be a JSON object with vLLM's --kv-events-config keys")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"kv_events_config: unknown key(s) {', '.join(_short(k) for k in unknown)}; "
                         f"allowed: {', '.join(known)}")
    for key, value in data.items():
        if not isinstance(value, KINDS[key]) or (isinstance(value, bool) and KINDS[key] is int):
            raise ValueError(f"kv_events_config: {key} has the wrong type ({_short(json.dumps(value))})")
        if isinstance(value, str):
            check_text(value, f"kv_events_config.{key}")
            if len(value) > MAX_TEXT:
                raise ValueError(f"kv_events_config: {key} is {len(value)} characters; the limit is {MAX_TEXT}")
        if key in RANGES and not RANGES[key][0] <= value <= RANGES[key][1]:
            low, high = RANGES[key]
            raise ValueError(f"kv_events_config: {key} must be >= {low} and <= {high}; got {_short(str(value))}")
    config = KVEventsConfig(**data)
    publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"kv_events_config: publisher must be zmq or null; got '{_short(publisher)}'")
    for key in ("endpoint", "replay_endpoint"):
        _check_endpoint(key, getattr(config, key), config.data_parallel_rank)
    if config.bind_host and not _HOST.match(config.bind_host):
        raise ValueError(f"kv_events_config: bind_host must be an address or a host name; got '{config.bind_host}'")
    return KVEventsConfig(**{**data, "publisher": publisher})


def _check_endpoint(key: str, value: Optional[str], rank: int) -> None:
    if value is None:
        return
    if not value.startswith(ENDPOINT_SCHEMES):
        raise ValueError(f"kv_events_config: {key} must be a ZMQ address ({', '.join(ENDPOINT_SCHEMES)}); "
                         f"got '{value}'")
    if value.startswith("tcp://"):
        found = _TCP.match(value)
        if found is None:
            raise ValueError(f"kv_events_config: {key} must be tcp://HOST:PORT (HOST an address, a name or *); "
                             f"got '{value}'")
        port = int(found["port"])
        if not 1 <= port + rank <= MAX_PORT or port < 1:
            raise ValueError(f"kv_events_config: {key}'s port {port} + data_parallel_rank {rank} must be in "
                             f"[1, {MAX_PORT}]")


def _short(text: str, limit: int = 60) -> str:
    """`text` as a refusal can show it: cut to `limit`, a lone surrogate escaped."""
    shown = text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"


def for_instance(raw: str, index: int, host: str = "") -> str:
    """kv_events_config for the index-th model instance of a server: its data_parallel_rank, and the
    server's bind host (`host`, unless the config names its own)."""
    config = parse_kv_events_config(raw)
    if config is None or not config.publishes or (index == 0 and (not host or config.bind_host)):
        return raw
    data = json.loads(raw)
    if index:
        data["data_parallel_rank"] = index
    if host and not config.bind_host:
        data["bind_host"] = host
    return json.dumps(data)
