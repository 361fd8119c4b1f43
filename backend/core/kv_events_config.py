"""`kv_events_config` (vLLM's `--kv-events-config` keys), parsed and checked once: what the
KV-cache events' publisher (backend/kv/event_publisher.py) is told to do. No torch, no ZMQ."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Optional

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """`kv_events_config`, parsed: vLLM's KVEventsConfig keys and defaults, and
    `data_parallel_rank`, which the server sets for the i-th model instance (its ports move up by
    i, as vLLM's data-parallel ranks' do, so that instances never collide)."""
    enable_kv_cache_events: bool = False
    publisher: str = ""  # "zmq" | "null"; "" follows enable_kv_cache_events, as vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    data_parallel_rank: int = 0

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(raw: str) -> Optional[KVEventsConfig]:
    """kv_events_config (JSON) -> KVEventsConfig, or None for "". ValueError names the key."""
    if not raw or not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("kv_events_config must be a JSON object with vLLM's --kv-events-config keys")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(known)}")
    kinds = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": (str, type(None)),
             "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str, "data_parallel_rank": int}
    for key, value in data.items():
        if not isinstance(value, kinds[key]) or (isinstance(value, bool) and kinds[key] is int):
            raise ValueError(f"kv_events_config: {key} has the wrong type ({json.dumps(value)})")
    config = KVEventsConfig(**data)
    publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"kv_events_config: publisher must be zmq or null; got '{publisher}'")
    for key in ("endpoint", "replay_endpoint"):
        value = getattr(config, key)
        if value is not None and not value.startswith(ENDPOINT_SCHEMES):
            raise ValueError(f"kv_events_config: {key} must be a ZMQ address ({', '.join(ENDPOINT_SCHEMES)}); "
                             f"got '{value}'")
    for key, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1), ("data_parallel_rank", 0)):
        if getattr(config, key) < low:
            raise ValueError(f"kv_events_config: {key} must be >= {low}; got {getattr(config, key)}")
    return KVEventsConfig(**{**data, "publisher": publisher})


def for_instance(raw: str, index: int) -> str:
    """kv_events_config for the index-th model instance of a server: its data_parallel_rank."""
    config = parse_kv_events_config(raw)
    if config is None or not config.publishes or index == 0:
        return raw
    return json.dumps({**json.loads(raw), "data_parallel_rank": index})
