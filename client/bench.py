"""`inflight bench`: throughput and latency of the batching modes, in-process or through Triton.

    # every mode, in-process, one engine per mode, a concurrency sweep; JSON + CSV + PNG
    inflight bench --in-process --model-path models/default --mode inflight,static,dynamic,none \\
        --workload mixed --num-requests 128 --concurrency 1,16,64 --output-json bench.json

    # against a running server (gRPC streaming; --protocol http uses generate_stream)
    inflight bench --url localhost:8001 --workload mixed --concurrency 64

    # in-flight in-process and through a local tritonserver, in the same run, with their ratio
    # (--also-no-stream adds the server with one response per request, as a third target)
    inflight bench --compare-server --model-path models/default --concurrency 64 --also-no-stream

    # offline: LLM.generate on the whole workload at once, per mode (no latencies)
    inflight bench --offline --model-path models/default --mode inflight,none

Each (target, mode, concurrency) run sends the same seeded workload (client/workloads.py) with at
most `concurrency` requests in flight (closed loop), or at Poisson arrivals (`--rate`) still capped
by `concurrency`. Times are taken where the client sees them: in-process in the engine's output
callback, through the server when a response arrives. Reported per run: output tokens/s,
requests/s, TTFT / inter-token / end-to-end latency at p50 and p99, KV-cache usage (peak and
mean, sampled every 50 ms: `stats()` in-process, the `inflight_kv_cache_usage_ratio` metric
through the server), preemptions, and failed requests. The static and dynamic modes answer each
request once, when its batch ends, so their TTFT equals their end-to-end latency and they have no
inter-token latency (reported as null). Ratios are always taken within one invocation.

The exit code is 1 when any request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as _dt
import json
import platform
import re
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from client.workloads import DEFAULT_VOCAB_SIZE, WorkItem, make_workload, summary

MODES = ("inflight", "static", "dynamic", "none")
METRIC_KEYS = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
               "itl_p99_s", "e2e_p50_s", "e2e_p99_s")
CSV_KEYS = ("target", "mode", "concurrency", "repeat", "rate", "num_requests", "completed", "failed", "duration_s",
            "output_tokens", *METRIC_KEYS, "kv_usage_peak", "kv_usage_mean", "running_mean", "preemptions", "cpu_s",
            "output_tokens_per_cpu_s")


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
        return {"kv_usage_peak": max(usage) if usage else None,
                "kv_usage_mean": float(np.mean(usage)) if usage else None,
                "running_mean": float(np.mean(running)) if running else None,
                "preemptions": (max(pre) - preemptions_before) if pre and preemptions_before is not None else None}


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr, leave=False)


# -- in-process --------------------------------------------------------------------------------
class InProcessTarget:
    """One AsyncEngine (the engine the server runs) built for one batching mode."""
    name = "in-process"

    def __init__(self, model_path: str, mode: str, params: dict[str, str]):
        from backend.config import EngineConfig
        from backend.engine import AsyncEngine

        self.mode = mode
        self.config = EngineConfig.from_params(params, model_path=str(model_path), batching_mode=mode)
        self.engine = AsyncEngine(self.config)
        self.vocab_size = self.engine.vocab_size
        self._runs = 0

    def close(self) -> None:
        self.engine.shutdown()

    def _stats(self) -> dict:
        s = self.engine.stats()
        return {"kv": s["kv_cache_usage_ratio"], "running": s["num_requests_running"],
                "preemptions": s["num_preemptions"]}

    def run(self, items: Sequence[WorkItem], concurrency: int, progress: bool = False,
            timeout: float = 3600.0) -> dict[str, Any]:
        from backend.request import SamplingParams

        self._runs += 1
        records = [Record(item) for item in items]
        slots = threading.Semaphore(concurrency)
        done = threading.Event()
        lock = threading.Lock()
        remaining = [len(records)]
        bar = _progress(len(records), f"{self.name} {self.mode} c={concurrency}", progress)

        def finish(rec: Record) -> None:
            slots.release()
            with lock:
                remaining[0] -= 1
                bar.update(1)
                if remaining[0] == 0:
                    done.set()

        def callback(rec: Record):
            def on_output(out) -> None:
                now = time.monotonic()
                if out.new_token_ids:
                    rec.chunks.append((now, len(out.new_token_ids)))
                if out.finished:
                    rec.end = now
                    rec.num_output_tokens = len(out.token_ids)
                    rec.finish_reason = out.finish_reason
                    rec.error = out.error
                    finish(rec)
            return on_output

        before = self._stats()["preemptions"]
        cpu0 = time.process_time()
        with Sampler(self._stats) as sampler:
            start = time.monotonic()
            for rec in records:
                delay = start + rec.item.arrival_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                slots.acquire()
                rec.start = time.monotonic()
                params = SamplingParams(max_tokens=rec.item.max_tokens, temperature=0.0,
                                        ignore_eos=rec.item.ignore_eos)
                try:
                    self.engine.add_request(f"bench{self._runs}-{rec.item.index}", rec.item.prompt, params,
                                            callback(rec))
                except Exception as exc:  # refused at arrival (too long, queue full)
                    rec.error = f"{type(exc).__name__}: {exc}"
                    finish(rec)
            done.wait(timeout)
            duration = time.monotonic() - start
        cpu = time.process_time() - cpu0
        bar.close()
        result = {**summarize(records, duration), **sampler.report(before), "cpu_s": cpu}
        # CPU seconds of this process (engine threads included): steadier than wall time on a
        # machine shared with other jobs.
        result["output_tokens_per_cpu_s"] = result["output_tokens"] / cpu if cpu > 0 else None
        return result


class OfflineTarget:
    """`LLM(...).generate(all prompts)` for one batching mode: offline throughput, no latencies."""
    name = "offline"

    def __init__(self, model_path: str, mode: str, params: dict[str, str]):
        import dataclasses

        from backend import LLM
        from backend.config import EngineConfig

        self.mode = mode
        config = EngineConfig.from_params(params, model_path=str(model_path), batching_mode=mode)
        overrides = {k: v for k, v in dataclasses.asdict(config).items() if k != "model_path"}
        self.llm = LLM(str(model_path), **overrides)

    def close(self) -> None:
        pass

    def run(self, items: Sequence[WorkItem], concurrency: int, progress: bool = False,
            timeout: float = 3600.0) -> dict[str, Any]:
        from backend.request import SamplingParams

        params = [SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=w.ignore_eos) for w in items]
        before = self.llm.stats()["num_preemptions"]
        cpu0, start = time.process_time(), time.monotonic()
        outputs = self.llm.generate([w.prompt for w in items], params, use_tqdm=progress)
        duration, cpu = time.monotonic() - start, time.process_time() - cpu0
        tokens = sum(len(o.token_ids) for o in outputs)
        failed = sum(o.finish_reason in ("abort", "error") for o in outputs)
        none = dict.fromkeys(METRIC_KEYS[2:])
        return {"num_requests": len(items), "completed": len(items) - failed, "failed": failed,
                "duration_s": duration, "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
                "requests_per_s": (len(items) - failed) / duration, **none, "errors": [],
                "kv_usage_peak": None, "kv_usage_mean": None, "running_mean": None,
                "preemptions": self.llm.stats()["num_preemptions"] - before, "cpu_s": cpu,
                "output_tokens_per_cpu_s": tokens / cpu if cpu > 0 else None}


# -- through the server ------------------------------------------------------------------------
_METRIC_LINE = re.compile(r"^(inflight_[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+|nan|NaN)")


def scrape(metrics_url: str, timeout: float = 2.0) -> dict[str, float]:
    """Our gauges and counters from the Prometheus endpoint, summed over labels (one model)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m and 'state="' not in (m.group(2) or ""):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


def default_metrics_url(url: str) -> str:
    host = url.split("://")[-1].rsplit(":", 1)[0] or "localhost"
    return f"http://{host}:8002/metrics"


class ServerTarget:
    """A running tritonserver serving `llm`: gRPC streaming (or HTTP generate_stream)."""

    def __init__(self, url: str, protocol: str = "grpc", metrics_url: Optional[str] = None,
                 vocab_size: int = DEFAULT_VOCAB_SIZE, server_pid: Optional[int] = None,
                 stream: bool = True):
        self.url, self.protocol, self.stream = url, protocol, stream
        self.server_pid = server_pid  # a local server we started: its CPU seconds are counted too
        self.name = f"server-{protocol}" + ("" if stream else "-nostream")
        self.metrics_url = metrics_url or default_metrics_url(url)
        self.vocab_size = vocab_size
        self.mode = self._server_mode()

    def close(self) -> None:
        pass

    def _server_mode(self) -> str:
        """The server's batching_mode, from its model configuration."""
        try:
            if self.protocol == "grpc":
                import tritonclient.grpc as g
                config = g.InferenceServerClient(self.url).get_model_config("llm", as_json=True)["config"]
            else:
                base = self.url if "://" in self.url else f"http://{self.url}"
                with urllib.request.urlopen(f"{base}/v2/models/llm/config", timeout=10) as r:
                    config = json.loads(r.read())
            params = config.get("parameters", {})
            static = params.get("executor_static_batch_size", {}).get("string_value", "-1")
            if static.strip() not in ("", "-1", "0"):
                return "static"
            return params.get("batching_mode", {}).get("string_value", "inflight")
        except Exception as exc:
            print(f"inflight bench: could not read the server's batching_mode ({exc})", file=sys.stderr)
            return "unknown"

    def _stats(self) -> Optional[dict]:
        m = scrape(self.metrics_url)
        return {"kv": m.get("inflight_kv_cache_usage_ratio"), "running": m.get("inflight_num_requests_running"),
                "preemptions": m.get("inflight_num_preemptions_total")}

    def run(self, items: Sequence[WorkItem], concurrency: int, progress: bool = False,
            timeout: float = 3600.0) -> dict[str, Any]:
        try:
            before = self._stats()["preemptions"]
        except Exception:
            before = None
        cpu0 = self._cpu()
        with Sampler(self._stats, interval=0.25) as sampler:
            records, duration = asyncio.run(self._run(items, concurrency, progress, timeout))
        result = {**summarize(records, duration), **sampler.report(before)}
        if cpu0 is not None:  # tritonserver + its stub + this client, as in-process counts engine + client
            cpu = self._cpu() - cpu0
            result["cpu_s"] = cpu
            result["output_tokens_per_cpu_s"] = result["output_tokens"] / cpu if cpu > 0 else None
        return result

    async def _chunks(self, client, item: WorkItem):
        """The responses of one request: one per step when streaming, else one at the end."""
        options = dict(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=item.ignore_eos,
                       exclude_input_in_output=True)
        if self.protocol == "grpc":
            async for chunk in client.stream(item.prompt, stream=self.stream, **options):
                yield chunk
        elif self.stream:
            async for chunk in client.stream(item.prompt, **options):
                yield chunk
        else:
            from client.protocol import Chunk
            r = await client.generate(item.prompt, **options)
            yield Chunk(r.text, r.token_ids, r.finish_reason, r.num_input_tokens, r.num_output_tokens,
                        time=r.end or time.monotonic())

    def _cpu(self) -> Optional[float]:
        """CPU seconds so far of the local server (tritonserver and its stubs) and this client."""
        if self.server_pid is None:
            return None
        import psutil

        from client.soak import cpu_seconds  # here: client.soak imports this module
        try:
            return time.process_time() + sum(cpu_seconds(self.server_pid).values())
        except psutil.Error:
            return None

    async def _run(self, items, concurrency, progress, timeout):
        if self.protocol == "grpc":
            from client.grpc_client import AsyncGrpcClient as Client
        else:
            from client.http_client import AsyncHttpClient as Client
        records = [Record(item) for item in items]
        slots = asyncio.Semaphore(concurrency)
        bar = _progress(len(records), f"{self.name} {self.mode} c={concurrency}", progress)
        async with Client(self.url) as client:
            start = time.monotonic()

            async def one(rec: Record) -> None:
                delay = start + rec.item.arrival_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with slots:
                    rec.start = time.monotonic()
                    try:
                        async for chunk in self._chunks(client, rec.item):
                            n = len(chunk.token_ids)
                            if n:
                                rec.chunks.append((chunk.time, n))
                                rec.num_output_tokens += n
                            if chunk.finished:
                                rec.end = chunk.time
                                rec.finish_reason = chunk.finish_reason
                                break
                        if rec.end is None:
                            rec.error = "the stream ended without a final response"
                    except Exception as exc:
                        rec.error = f"{type(exc).__name__}: {exc}"
                    bar.update(1)

            await asyncio.wait_for(asyncio.gather(*(one(r) for r in records)), timeout)
            duration = time.monotonic() - start
        bar.close()
        return records, duration


# -- a local tritonserver for --compare-server -------------------------------------------------
def start_local_server(model_path: str, params: dict[str, str]):
    """A tritonserver on free loopback ports serving model_path with the rendered default config
    (KIND_CPU when there is no GPU) plus `params`. Returns the started TritonServer."""
    import tempfile

    from client.server import TritonServer
    from templates.render import detect_gpus, write_config

    repo = Path(tempfile.mkdtemp(prefix="inflight-bench-repo-"))
    write_config(repo / "llm" / "config.pbtxt", gpus=detect_gpus())
    code = Path(__file__).resolve().parents[1] / "model_repository" / "llm" / "1"
    (repo / "llm" / "1").symlink_to(code, target_is_directory=True)
    server = TritonServer(repo, params=params, model_path=str(model_path))
    server.start()
    try:
        server.wait_ready(600)
    except BaseException:
        server.stop()
        raise
    return server


# -- reporting ---------------------------------------------------------------------------------
def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if unit == "ms":
            return f"{v * 1000:.0f}"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def print_table(results: Sequence[dict], out=sys.stdout) -> None:
    head = ("target", "mode", "conc", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
            "E2E p50", "E2E p99", "KV peak", "preempt", "failed")
    rows = [head, ("", "", "", "", "", "ms", "ms", "ms", "ms", "ms", "ms", "", "", "")]
    for r in results:
        conc = str(r["concurrency"]) + (f" #{r['repeat'] + 1}" if r.get("repeat") else "")
        rows.append((r["target"], r["mode"], conc, _fmt(r["requests_per_s"]),
                     _fmt(r["output_tokens_per_s"]), _fmt(r["ttft_p50_s"], "ms"), _fmt(r["ttft_p99_s"], "ms"),
                     _fmt(r["itl_p50_s"], "ms"), _fmt(r["itl_p99_s"], "ms"), _fmt(r["e2e_p50_s"], "ms"),
                     _fmt(r["e2e_p99_s"], "ms"),
                     "-" if r.get("kv_usage_peak") is None else f"{100 * r['kv_usage_peak']:.1f}%",
                     _fmt(r.get("preemptions")), str(r["failed"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))), file=out)


def ratios(results: Sequence[dict]) -> list[dict]:
    """In-flight against every other mode (same target and concurrency), and server against
    in-process (in-flight, same concurrency): output tokens/s ratios, on the means of the repeats,
    and repeat by repeat (`per_repeat`, the k-th run of one against the k-th of the other) so that
    the spread on a noisy machine shows."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["target"], r["mode"], r["concurrency"]), []).append(r)
    by = {}
    for key, rs in groups.items():  # repeats: the mean of their throughputs
        vals = [x["output_tokens_per_s"] for x in rs if x["output_tokens_per_s"]]
        by[key] = {"output_tokens_per_s": float(np.mean(vals)) if vals else None, "runs": vals}

    def ratio(kind: str, target: str, conc: int, a: dict, b: dict) -> dict:
        pairs = zip(a["runs"], b["runs"]) if len(a["runs"]) == len(b["runs"]) > 1 else ()
        return {"kind": kind, "target": target, "concurrency": conc,
                "ratio": a["output_tokens_per_s"] / b["output_tokens_per_s"],
                "per_repeat": [x / y for x, y in pairs]}

    for (target, mode, conc), r in by.items():
        if mode != "inflight" or not r["output_tokens_per_s"]:
            continue
        for other in MODES[1:]:
            o = by.get((target, other, conc))
            if o and o["output_tokens_per_s"]:
                out.append(ratio(f"inflight/{other}", target, conc, r, o))
        if target.startswith("server"):
            base = by.get(("in-process", "inflight", conc))
            if base and base["output_tokens_per_s"]:
                out.append({**ratio(f"{target}/in-process", target, conc, r, base),
                            "in_process_output_tokens_per_s": base["output_tokens_per_s"],
                            "server_output_tokens_per_s": r["output_tokens_per_s"]})
    return out


def write_csv(results: Sequence[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(r)


def plot(results: Sequence[dict], path: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    points: dict[tuple[str, str, int], list[dict]] = {}
    for r in results:
        points.setdefault((r["target"], r["mode"], r["concurrency"]), []).append(r)
    lines: dict[tuple[str, str], list[dict]] = {}
    for (target, mode, conc), rs in points.items():  # repeats: their mean
        mean = lambda k: float(np.mean([x[k] for x in rs])) if all(x[k] is not None for x in rs) else None  # noqa: E731
        lines.setdefault((target, mode), []).append(
            {"concurrency": conc, "output_tokens_per_s": mean("output_tokens_per_s"), "e2e_p99_s": mean("e2e_p99_s")})
    for (target, mode), rs in lines.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        label = mode if target == "in-process" else f"{mode} ({target})"
        xs = [r["concurrency"] for r in rs]
        tput = [r["output_tokens_per_s"] or 0 for r in rs]
        ax1.plot(xs, tput, marker="o", label=label)
        ax2.plot(tput, [(r["e2e_p99_s"] or float("nan")) for r in rs], marker="o", label=label)
        for r, x, y in zip(rs, tput, [(r["e2e_p99_s"] or float("nan")) for r in rs]):
            ax2.annotate(f"c={r['concurrency']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax1.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="output tokens/s",
            title="throughput vs concurrency")
    ax1.set_xticks(sorted({r["concurrency"] for r in results}))
    ax1.set_xticklabels([str(c) for c in sorted({r["concurrency"] for r in results})])
    ax2.set(yscale="log", xlabel="output tokens/s", ylabel="p99 end-to-end latency (s)",
            title="p99 latency vs throughput")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "no GPU"
    try:
        import torch
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return (f"{psutil.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
            f"{gpu}, {platform.system()} {platform.release()}, Python {platform.python_version()}")


# -- command line ------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be >= 1")
    return values


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(MODES)}; got {text!r}")
    return modes


def _param(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    return key.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inflight bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("where")
    where.add_argument("--in-process", action="store_true", help="run the engine in this process (needs --model-path)")
    where.add_argument("--model-path", help="checkpoint folder for --in-process / --compare-server")
    where.add_argument("--url", help="a running server: gRPC host:port (default localhost:8001), or HTTP with --protocol http")
    where.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    where.add_argument("--no-stream", action="store_true",
                       help="through the server: one response per request (no TTFT/ITL) instead of one per step")
    where.add_argument("--also-no-stream", action="store_true",
                       help="with --compare-server: measure the server both ways in the same run, "
                            "streaming and one response per request")
    where.add_argument("--metrics-url", help="the server's Prometheus endpoint (default: the url's host, port 8002)")
    where.add_argument("--offline", action="store_true",
                       help="LLM.generate on the whole workload at once, per --mode (needs --model-path)")
    where.add_argument("--compare-server", action="store_true",
                       help="in-flight in-process AND through a server in the same run, with their ratio "
                            "(starts a local tritonserver unless --url is given)")
    what = p.add_argument_group("what")
    what.add_argument("--mode", type=_modes, default=["inflight"],
                      help="in-process: comma list of inflight,static,dynamic,none (one engine each); "
                           "a server reports its own mode")
    what.add_argument("--workload", default="mixed", help="fixed | mixed | FILE.jsonl (default mixed)")
    what.add_argument("--num-requests", type=int, default=128)
    what.add_argument("--concurrency", type=_ints, default=[16], help="requests in flight; a comma list sweeps")
    what.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at once)")
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    what.add_argument("--fixed-prompt-len", type=int, default=128)
    what.add_argument("--fixed-output-len", type=int, default=64)
    what.add_argument("--max-output-len", type=int, default=None, help="cap every output length")
    what.add_argument("--param", type=_param, action="append", default=[], metavar="KEY=VALUE",
                      help="engine parameter (config.pbtxt key) for in-process engines and a started server")
    what.add_argument("--warmup", type=int, default=4,
                      help="untimed requests before each target's first run: the workload's longest "
                           "prompts, 4 output tokens each")
    what.add_argument("--repeats", type=int, default=1,
                      help="measure each run this many times, alternating targets (A B B A ...) under "
                           "--compare-server; ratios use the means")
    out = p.add_argument_group("output")
    out.add_argument("--output-json", type=Path)
    out.add_argument("--csv", type=Path, help="default: --output-json with .csv")
    out.add_argument("--plot", type=Path, help="default: --output-json with .png")
    out.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_requests < 1:
        print("inflight bench: --num-requests must be >= 1", file=sys.stderr)
        return 2
    if (args.in_process or args.compare_server or args.offline) and not args.model_path:
        print("inflight bench: --in-process, --offline and --compare-server need --model-path DIR", file=sys.stderr)
        return 2
    if args.model_path and not Path(args.model_path).is_dir():
        print(f"inflight bench: --model-path {args.model_path} is not a folder", file=sys.stderr)
        return 2
    params = dict(args.param)
    progress = not args.no_progress and sys.stderr.isatty()
    tokenizer = None
    vocab = DEFAULT_VOCAB_SIZE
    if args.model_path:
        from backend.loader import load_model_config
        vocab = load_model_config(args.model_path).vocab_size
        if args.prompt_format == "text":
            from backend.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_dir(args.model_path)
    try:
        items = make_workload(args.workload, args.num_requests, seed=args.seed, rate=args.rate,
                              prompt_format=args.prompt_format, vocab_size=vocab, tokenizer=tokenizer,
                              fixed_prompt_len=args.fixed_prompt_len, fixed_output_len=args.fixed_output_len,
                              max_output_len=args.max_output_len)
    except ValueError as exc:
        print(f"inflight bench: {exc}", file=sys.stderr)
        return 2
    # Warm-up on the workload's longest prompts: the first long attention shapes and allocations
    # are paid before the clock starts, by every target alike.
    longest = sorted(items, key=lambda w: -w.prompt_len)[:max(args.warmup, 0)]
    warm = [WorkItem(i, w.prompt, w.prompt_len, min(4, w.max_tokens), 0.0, True) for i, w in enumerate(longest)]

    results: list[dict] = []
    started = _dt.datetime.now().astimezone()
    server = None

    def measure(target, concurrencies) -> None:
        if warm and not getattr(target, "warmed", False):  # untimed: first-call costs out of the way
            target.run(warm, len(warm))
            target.warmed = True
        for c in ([len(items)] if isinstance(target, OfflineTarget) else concurrencies):
            r = target.run(items, c, progress)
            row = {"target": target.name, "mode": target.mode, "concurrency": c, "rate": args.rate,
                   "repeat": sum(x["target"] == target.name and x["mode"] == target.mode
                                 and x["concurrency"] == c for x in results), **r}
            results.append(row)
            print(f"  {target.name:<12} {target.mode:<8} c={c:<4} {_fmt(r['output_tokens_per_s'])} out tok/s, "
                  f"{_fmt(r['requests_per_s'])} req/s, p99 e2e {_fmt(r['e2e_p99_s'], 'ms')} ms, "
                  f"failed {r['failed']}", file=sys.stderr, flush=True)

    try:
        if args.compare_server:
            if args.url:
                url, metrics_url, pid = args.url, args.metrics_url, None
            else:
                print("inflight bench: starting a local tritonserver ...", file=sys.stderr, flush=True)
                server = start_local_server(args.model_path, {**params, "batching_mode": "inflight"})
                url = server.grpc_url if args.protocol == "grpc" else server.http_url
                metrics_url, pid = server.metrics_url, server.process.pid
            streams = [True, False] if args.also_no_stream else [not args.no_stream]
            servers = [ServerTarget(url, args.protocol, metrics_url, vocab, pid, stream=s) for s in streams]
            local = InProcessTarget(args.model_path, "inflight", params)
            try:
                targets = [local, *servers]
                for c in args.concurrency:  # interleaved (A B C C B A), so that load drift hits all alike
                    for i in range(args.repeats):
                        for t in (targets if i % 2 == 0 else targets[::-1]):
                            measure(t, [c])
            finally:
                local.close()
        elif args.in_process or args.offline:
            kind = OfflineTarget if args.offline else InProcessTarget
            # Modes take turns at each concurrency, in alternating order per repeat (A B C,
            # C B A, ...), so that a slow spell on a shared machine hits them alike. Each turn
            # builds its engine (before the clock starts) and closes it after: idle engines on
            # other threads keep their own OpenMP pools, and three idle ones made the running
            # engine about 2x slower on 2 cores.
            for c in ([len(items)] if args.offline else args.concurrency):
                for i in range(args.repeats):
                    for mode in (args.mode if i % 2 == 0 else args.mode[::-1]):
                        target = kind(args.model_path, mode, params)
                        try:
                            measure(target, [c])
                        finally:
                            target.close()
        else:
            target = ServerTarget(args.url or "localhost:8001", args.protocol, args.metrics_url, vocab,
                                  stream=not args.no_stream)
            if args.mode != ["inflight"] and target.mode not in args.mode:
                print(f"inflight bench: the server runs batching_mode={target.mode}; --mode is for "
                      f"--in-process (reporting the server's mode)", file=sys.stderr)
            for _ in range(args.repeats):
                measure(target, args.concurrency)
    except KeyboardInterrupt:
        print("inflight bench: interrupted", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()

    print()
    print_table(results)
    rs = ratios(results)
    if rs:
        print()
        for r in rs:
            extra = ""
            if "in_process_output_tokens_per_s" in r:
                extra = (f"  (server {r['server_output_tokens_per_s']:.0f} vs in-process "
                         f"{r['in_process_output_tokens_per_s']:.0f} out tok/s)")
            if r["per_repeat"]:
                extra += "  repeat by repeat: " + ", ".join(f"{x:.2f}x" for x in r["per_repeat"])
            print(f"c={r['concurrency']:<4} {r['kind']:<28} {r['ratio']:.2f}x{extra}")
    meta = {"date": started.isoformat(timespec="seconds"), "machine": machine(),
            "command": "inflight bench " + " ".join(sys.argv[1:] if argv is None else argv),
            "workload": args.workload, "seed": args.seed, "rate": args.rate,
            "workload_summary": summary(items), "params": params}
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({"meta": meta, "results": results, "ratios": rs}, indent=2))
        csv_path = args.csv or args.output_json.with_suffix(".csv")
        plot_path = args.plot or args.output_json.with_suffix(".png")
    else:
        csv_path, plot_path = args.csv, args.plot
    if csv_path:
        write_csv(results, csv_path)
    if plot_path and results:
        plot(results, plot_path, f"{args.workload} workload, {len(items)} requests - {meta['machine']} - "
                                 f"{meta['date']}")
    failed = sum(r["failed"] for r in results)
    if failed:
        errors = sorted({e for r in results for e in r.get("errors", [])})
        print(f"inflight bench: {failed} request(s) failed: {'; '.join(errors[:5])}", file=sys.stderr)
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
