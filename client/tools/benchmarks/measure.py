"""What `inflight bench` records per request and how a run is summed up: latencies at p50/p99,
throughput, and the gauges (KV usage, running requests) sampled while it runs."""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from client.tools.benchmarks.workloads import WorkItem

MODES = ("inflight", "static", "dynamic", "none")
METRIC_KEYS = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
               "itl_p99_s", "e2e_p50_s", "e2e_p99_s")


# -- one request as the client saw it ------------------------------------------------------------
@dataclass
class Record:
    item: WorkItem
    start: Optional[float] = None
    end: Optional[float] = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, new tokens)
    num_output_tokens: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and self.finish_reason not in ("abort", "error")


def _pct(values: Sequence[float], q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(records: Sequence[Record], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.chunks[0][0] - r.start for r in ok if r.chunks]
    e2e = [r.end - r.start for r in ok]
    itl: list[float] = []
    for r in ok:
        for (t0, _), (t1, k) in zip(r.chunks, r.chunks[1:]):
            itl.extend([(t1 - t0) / k] * k)
    tokens = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration, "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else None,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
        "e2e_p50_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99),
        "errors": sorted({r.error or f"finish_reason={r.finish_reason}" for r in records if not r.ok})[:5],
    }


def cpu_figures(output_tokens: int, cpu_s: float) -> dict[str, Any]:
    """A run's CPU seconds and output tokens per CPU-second: steadier than wall time on a machine
    shared with other jobs."""
    return {"cpu_s": cpu_s, "output_tokens_per_cpu_s": output_tokens / cpu_s if cpu_s > 0 else None}


class Sampler:
    """Samples a gauge function every `interval` s on a thread: KV usage, running requests."""

    def __init__(self, read: Callable[[], Optional[dict]], interval: float = 0.05):
        self.read, self.interval = read, interval
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                s = self.read()
            except Exception:
                s = None
            if s:
                self.samples.append(s)
            self._stop.wait(self.interval)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, preemptions_before: Optional[float]) -> dict[str, Any]:
        usage = [s["kv"] for s in self.samples if s.get("kv") is not None]
        running = [s["running"] for s in self.samples if s.get("running") is not None]
        pre = [s["preemptions"] for s in self.samples if s.get("preemptions") is not None]
        waiting = [s["waiting"] for s in self.samples if s.get("waiting") is not None]
        return {"kv_usage_peak": max(usage) if usage else None,
                "kv_usage_mean": float(np.mean(usage)) if usage else None,
                "running_mean": float(np.mean(running)) if running else None,
                "waiting_mean": float(np.mean(waiting)) if waiting else None,  # the queue: requests not admitted yet
                "waiting_peak": max(waiting) if waiting else None,
                "preemptions": (max(pre) - preemptions_before) if pre and preemptions_before is not None else None}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr, leave=False)
