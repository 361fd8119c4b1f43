"""The OpenAI port's /metrics: the inference gateway's model-server protocol (docs/gateway.md).

The endpoint picker of the Gateway API Inference Extension (llm-d's router) scrapes the port it
routes to for the protocol's metrics, under vLLM's names by default. The engines live in Triton's
Python-backend stubs and export their gauges on Triton's metrics port, one series per model instance;
this process is a separate translator. So each scrape here reads Triton's /metrics afresh (scrapes
that arrive together share one read), sums the model's instances into one pod's figures, and serves
them under our names and vLLM's: the series, their help texts and vLLM's names are templates/metrics.py's
GATEWAY table (docs/metrics.md), each keyed by the figure it shows; the Triton series read are its
TRITON table's, by the engine's stats() key.

Summing: requests and blocks add up; utilisation is the summed used blocks over the summed total
(instances may differ in size); num_gpu_blocks and max_lora add up (a pod of two engines holds both
caches and twice the adapter slots); the LoRA lists are the instances' latest lists joined, and the
info gauge's value is the latest change (vLLM's: a Unix time, so a reader takes the newest series).

When Triton does not answer within the timeout, or has no inflight series for the model (not
loaded, or unloaded after a failure), the scrape fails with 503 and says why: zeros would tell a
router that this pod is idle and draw traffic to it.
"""
from __future__ import annotations

import asyncio
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from fastapi.responses import PlainTextResponse

from templates import metrics as table
from templates.exposition import Sample, matching, parse_exposition

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


_TRITON = table.by_key(table.TRITON)  # Triton's series, by the engine's stats() key
_RUNNING, _WAITING = _TRITON["num_requests_running"].name, _TRITON["num_requests_waiting"].name
_BLOCKS, _CACHE, _LORA = _TRITON["kv_blocks_used"], _TRITON["cache_config"].name, _TRITON["lora_info"].name
_GATEWAY = table.by_key(table.GATEWAY)  # the OpenAI port's series, by the figure each shows
_BLOCK_STATES = _GATEWAY["used"].keys  # the pod's inflight_kv_blocks: used, free, total -> {"state": ...}
_TYPES = {table.GAUGE: "gauge", table.INFO: "gauge"}  # an info gauge is a gauge on the wire


class MetricsUnavailable(RuntimeError):
    """Triton's metrics could not give this pod's figures; the message says why."""


@dataclass
class PodFigures:
    """One pod's protocol figures: the model's instances summed."""
    instances: int
    running: float
    waiting: float
    blocks_used: float
    blocks_total: float
    block_size: Optional[str] = None
    lora: Optional[dict] = None  # max_lora, running, waiting (lists), updated (Unix time)
    blocks: dict = field(default_factory=dict)

    @property
    def usage(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


def aggregate(samples: list[Sample], model: str) -> PodFigures:
    """Triton's samples -> the model's figures, every instance summed (MetricsUnavailable if none)."""
    mine = [s for s in samples if s.labels.get("model") == model and s.name.startswith(table.PREFIX)]
    instances = {s.labels.get("instance") for s in mine if s.name == _RUNNING}
    if not instances:
        raise MetricsUnavailable(f"no {table.PREFIX}* series for model '{model}' (is the model loaded and ready?)")

    def total(name: str, **match: str) -> float:
        return sum(s.value for s in matching(mine, name, **match))

    blocks = {state: total(_BLOCKS.name, **_BLOCKS.keys[f"kv_blocks_{state}"]) for state in _BLOCK_STATES}
    figures = PodFigures(len(instances), total(_RUNNING), total(_WAITING), blocks["used"], blocks["total"],
                         blocks=blocks)
    cache = [s for s in mine if s.name == _CACHE]
    if cache:
        figures.block_size = cache[0].labels.get("block_size")
        figures.blocks["num_gpu_blocks"] = sum(int(s.labels.get("num_gpu_blocks", 0)) for s in cache)
    latest: dict = {}  # instance -> its newest lora_requests_info series
    for s in mine:
        if s.name == _LORA:
            key = s.labels.get("instance")
            if key not in latest or s.value > latest[key].value:
                latest[key] = s
    if latest:
        def joined(label: str) -> list[str]:
            names = [n.strip() for s in latest.values() for n in s.labels.get(label, "").split(",")]
            return list(dict.fromkeys(n for n in names if n))
        figures.lora = {"max_lora": sum(int(s.labels.get("max_lora", 0)) for s in latest.values()),
                        "running": joined("running_lora_adapters"), "waiting": joined("waiting_lora_adapters"),
                        "updated": max(s.value for s in latest.values())}
    return figures


def render(figures: PodFigures, model_name: str) -> str:
    """The figures in the text exposition format, under our names and vLLM's: each GATEWAY series
    whose figure the pod has (cache_config once Triton reports it, lora_info with LoRA on)."""
    base = dict(zip(table.GATEWAY_LABELS, (model_name,)))
    values: dict[str, list[tuple[dict, float]]] = {
        "running": [({}, figures.running)], "waiting": [({}, figures.waiting)], "usage": [({}, figures.usage)],
        "instances": [({}, figures.instances)],
        **{state: [(fixed, figures.blocks[state])] for state, fixed in _BLOCK_STATES.items()}}
    if figures.block_size is not None:
        values["cache_config"] = [({"block_size": figures.block_size,
                                    "num_gpu_blocks": str(figures.blocks["num_gpu_blocks"])}, 1)]
    if figures.lora is not None:
        lora = figures.lora
        values["lora_info"] = [({"max_lora": str(lora["max_lora"]), "running_lora_adapters": ",".join(lora["running"]),
                                 "waiting_lora_adapters": ",".join(lora["waiting"])}, lora["updated"])]
    lines: list[str] = []
    for metric in table.GATEWAY:
        series = [one for key in metric.keys for one in values.get(key, ())]
        for name in (n for n in (metric.name, metric.vllm) if n and series):
            lines.append(f"# HELP {name} {metric.help}")
            lines.append(f"# TYPE {name} {_TYPES[metric.kind]}")
            for labels, value in series:
                lines.append(f"{name}{_labels({**base, **labels})} {_number(value)}")
    return "\n".join(lines) + "\n"


def _labels(labels: dict) -> str:
    def escape(value) -> str:
        return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    return str(int(value)) if math.isfinite(value) and value == int(value) else repr(float(value))


def default_metrics_url(grpc_url: str) -> str:
    """Triton's metrics address beside its gRPC address: the same host, port 8002."""
    host = grpc_url.split("://", 1)[-1].rsplit(":", 1)[0] or "127.0.0.1"
    return f"http://{host}:8002/metrics"


class GatewayMetrics:
    """Serves /metrics: one fresh read of Triton's metrics per scrape, shared by concurrent scrapes."""

    def __init__(self, url: str, model: str = "llm", served_model_name: str = "llm", timeout: float = 2.0):
        self.url = url
        self.model = model
        self.served_model_name = served_model_name
        self.timeout = timeout
        self._read: Optional[asyncio.Task] = None

    def _fetch(self) -> str:
        with urllib.request.urlopen(self.url, timeout=self.timeout) as response:
            return response.read().decode("utf-8", errors="replace")

    async def figures(self) -> PodFigures:
        if self._read is None or self._read.done():
            self._read = asyncio.ensure_future(asyncio.wait_for(asyncio.to_thread(self._fetch), self.timeout))
        started = time.monotonic()
        try:
            text = await asyncio.shield(self._read)
        except (asyncio.TimeoutError, urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc or "timed out"
            raise MetricsUnavailable(f"Triton's metrics endpoint {self.url} did not answer "
                                     f"({type(exc).__name__}: {reason}; timeout {self.timeout:g}s, "
                                     f"{time.monotonic() - started:.1f}s spent)") from None
        return aggregate(parse_exposition(text), self.model)

    async def response(self) -> PlainTextResponse:
        try:
            figures = await self.figures()
        except MetricsUnavailable as exc:
            return PlainTextResponse(f"inflight: no metrics: {exc}\n", status_code=503)
        return PlainTextResponse(render(figures, self.served_model_name), media_type=CONTENT_TYPE)
