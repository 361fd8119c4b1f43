"""The soak test: a bounded Locust run against a local tritonserver that this script starts, with
the checks that say whether anything was lost or leaked.

    make soak                                          # 2 minutes (the figures in docs/reliability.md)
    .venv/bin/python -m client.tools.load.soak --duration 12      # the short version `make test` runs

What it does:
1. starts the real tritonserver (serving/triton_launcher.py) on free loopback ports, on the repository's
   model_repository with `--param` overrides (max_num_seqs 8 by default), with glibc's mmap
   threshold fixed at 16 MiB (`--malloc-mmap-threshold`; see run() for why);
2. warms it up with the heaviest steps the workload can make (max_num_seqs requests with the
   longest prompt at once, twice), so that what is compared later is growth, not warm-up;
3. runs Locust headless (client/tools/load/soak_locustfile.py) with 2 x max_num_seqs users for `--duration`
   seconds: gRPC streams, HTTP generate and HTTP generate_stream, mixed prompt and output lengths,
   a `--cancel` share of the requests cancelled part-way at random (each the way its protocol
   allows); meanwhile it samples, every second, the resident memory of tritonserver and of its
   Python stub (psutil) and the engine's gauges from the metrics endpoint;
4. after Locust stops, waits for the server to go idle and stops it (always, whatever happens).

It passes when: no request that was not cancelled failed; every request sent completed, was
cancelled or was rejected at arrival (none is left in flight); the used KV blocks are back at 0;
and the median resident memory (tritonserver + stub) of the last minute of load is less than 10%
above the first minute's (a run shorter than 2 minutes compares its first and last quarter).
Exit code 0 when it passes, 1 when it does not; `--json` writes every figure.

Nothing leaves the machine: the server listens on 127.0.0.1 only, and the run ends by itself
(Locust's --run-time, then --stop-timeout; the whole run is killed past duration + 120 s).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from client.tools.benchmarks.report import machine
from templates.exposition import read_page

REPO_ROOT = Path(__file__).resolve().parents[3]
LOCUSTFILE = REPO_ROOT / "client" / "tools" / "load" / "soak_locustfile.py"
GROWTH_LIMIT = 0.10
MMAP_THRESHOLD = 16 << 20  # see run()


def scrape(metrics_url: str) -> dict[str, float]:
    """Our gauges from the metrics endpoint: 'name' or 'name{state}' -> value."""
    return {s.name + (f"{{{s.labels['state']}}}" if "state" in s.labels else ""): s.value
            for s in read_page(metrics_url, timeout=5) if s.name.startswith("inflight_")}


def server_processes(pid: int):
    """tritonserver and its Python-backend stub(s), as psutil processes."""
    import psutil

    root = psutil.Process(pid)
    stubs = [p for p in root.children(recursive=True)
             if "triton_python_backend_stub" in " ".join(_cmdline(p))]
    return root, stubs


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:
        return []


def cpu_seconds(pid: int) -> dict[str, float]:
    """User and system CPU seconds of tritonserver and its stubs so far (unrounded: callers take
    differences)."""
    root, stubs = server_processes(pid)
    user = system = 0.0
    for p in [root, *stubs]:
        try:
            t = p.cpu_times()
            user, system = user + t.user, system + t.system
        except Exception:
            pass
    return {"user": user, "system": system}


def rss_mb(pid: int) -> tuple[float, float]:
    """Resident memory of tritonserver and of its stubs, in MiB."""
    root, stubs = server_processes(pid)
    stub = 0.0
    for p in stubs:
        try:
            stub += p.memory_info().rss
        except Exception:
            pass
    return root.memory_info().rss / 2**20, stub / 2**20


class Sampler(threading.Thread):
    """Every `interval` seconds: memory of tritonserver + stub, and the engine's gauges."""

    def __init__(self, server, interval: float = 1.0):
        super().__init__(name="soak-sampler", daemon=True)
        self.server, self.interval = server, interval
        self.samples: list[dict] = []
        self._halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def sample(self) -> Optional[dict]:
        try:
            server_mb, stub_mb = rss_mb(self.server.process.pid)
            gauges = scrape(self.server.metrics_url)
        except Exception:
            return None
        s = {"t": round(time.monotonic() - self.t0, 2), "tritonserver_mb": round(server_mb, 1),
             "stub_mb": round(stub_mb, 1), "total_mb": round(server_mb + stub_mb, 1),
             "kv_used": _int(gauges.get("inflight_kv_blocks{used}")),
             "running": _int(gauges.get("inflight_num_requests_running")),
             "waiting": _int(gauges.get("inflight_num_requests_waiting"))}
        self.samples.append(s)
        return s

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def _int(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(value)


def memory_windows(samples: list[dict], start: float, end: float) -> dict:
    """Median resident memory in the first and the last minute of the load (for a run shorter than
    2 minutes, in its first and last quarter)."""
    window = 60.0 if end - start >= 120 else (end - start) / 4
    load = [s for s in samples if start <= s["t"] <= end]
    first = [s for s in load if s["t"] <= start + window]
    last = [s for s in load if s["t"] >= end - window]
    if not first or not last:
        return {"window_s": window, "start_mb": None, "end_mb": None, "growth": None}
    out = {"window_s": round(window, 1)}
    for key in ("total_mb", "tritonserver_mb", "stub_mb"):
        a, b = statistics.median(s[key] for s in first), statistics.median(s[key] for s in last)
        out[key.replace("_mb", "")] = {"start_mb": round(a, 1), "end_mb": round(b, 1),
                                       "growth": round(b / a - 1, 4) if a else None}
    out["start_mb"], out["end_mb"], out["growth"] = (out["total"]["start_mb"], out["total"]["end_mb"],
                                                     out["total"]["growth"])
    out["peak_mb"] = max(s["total_mb"] for s in load)
    return out


def warm_up(server, max_num_seqs: int, prompt_len: int = 1024, rounds: int = 2) -> float:
    """max_num_seqs requests with the longest prompt of the mixed workload, at once, `rounds` times."""
    from client.grpc_client import GrpcClient

    started = time.monotonic()
    for r in range(rounds):
        errors = []

        def one(i):
            try:
                with GrpcClient(server.grpc_url, timeout=120) as client:
                    client.generate([3 + (i * 7 + j + r) % 1990 for j in range(prompt_len)], max_tokens=4)
            except Exception as exc:  # reported: a warm-up failure means the server is not healthy
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(max_num_seqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        if errors:
            raise RuntimeError(f"the warm-up failed: {errors[0]}")
    return time.monotonic() - started


def run(duration: float = 120.0, max_num_seqs: int = 8, users: Optional[int] = None, cancel: float = 0.1,
        max_tokens: int = 64, params: Optional[dict] = None, model_repository: Optional[Path] = None,
        model_path: Optional[str] = None, workdir: Optional[Path] = None, seed: int = 0,
        malloc_mmap_threshold: Optional[int] = MMAP_THRESHOLD, log=print) -> dict:
    """One soak run; returns the report (report["passed"] says whether it passed).

    `malloc_mmap_threshold` (bytes; 0 or None: glibc's default) fixes glibc's mmap threshold in the
    server (MALLOC_MMAP_THRESHOLD_). By default glibc raises that threshold to the largest buffer
    freed so far, then keeps such buffers in its heap once they are freed: on CPU, where the
    activations live in host memory, resident memory then moves by tens to hundreds of MiB with
    the largest steps seen, leak or no leak (docs/reliability.md). At 16 MiB, the big activation
    buffers go back to the system when freed and resident memory follows live memory, at no
    throughput cost in our runs (4 MiB cost a quarter of it), so the growth check measures growth."""
    from serving.triton_launcher import DEFAULT_MODEL_REPOSITORY, TritonServer

    users = users or 2 * max_num_seqs
    params = {"max_num_seqs": str(max_num_seqs), **(params or {})}
    workdir = Path(workdir or tempfile.mkdtemp(prefix="inflight-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    counts_path = workdir / "counts.json"
    report: dict = {
        "command": " ".join([Path(sys.executable).name, "-m", "client.tools.load.soak", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "duration_s": duration, "users": users, "max_num_seqs": max_num_seqs,
        "cancel_share": cancel, "max_tokens": max_tokens, "params": params,
    }
    server_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if malloc_mmap_threshold:
        server_env["MALLOC_MMAP_THRESHOLD_"] = str(int(malloc_mmap_threshold))
    report["malloc_mmap_threshold"] = malloc_mmap_threshold
    server = TritonServer(model_repository or DEFAULT_MODEL_REPOSITORY, params=params, model_path=model_path,
                          env=server_env)
    sampler = None
    try:
        started = time.monotonic()
        server.start()
        server.wait_ready(300)
        log(f"soak: tritonserver ready in {time.monotonic() - started:.1f}s "
            f"(gRPC {server.grpc_url}, HTTP {server.http_url}); {users} users for {duration:.0f}s")
        report["warm_up_s"] = round(warm_up(server, max_num_seqs), 1)
        sampler = Sampler(server)
        cpu_before = cpu_seconds(server.process.pid)
        sampler.start()
        load_start = time.monotonic() - sampler.t0
        env = dict(os.environ, INFLIGHT_GRPC_URL=server.grpc_url, INFLIGHT_SOAK_REPORT=str(counts_path),
                   INFLIGHT_SOAK_CANCEL=str(cancel), INFLIGHT_MAX_TOKENS=str(max_tokens),
                   INFLIGHT_SOAK_SEED=str(seed), PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
        locust = Path(sys.executable).with_name("locust")
        cmd = [str(locust), "-f", str(LOCUSTFILE), "--headless", "-u", str(users), "-r", str(users),
               "-t", f"{int(duration)}s", "--stop-timeout", "60", "--host", f"http://{server.http_url}",
               "--csv", str(workdir / "locust"), "--only-summary", "--loglevel", "WARNING"]
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=duration + 120)
        load_end = time.monotonic() - sampler.t0
        cpu_after = cpu_seconds(server.process.pid)
        report["server_cpu_s"] = {k: round(cpu_after[k] - cpu_before[k], 1) for k in cpu_after}
        report["locust_exit_code"] = proc.returncode
        if not counts_path.exists():
            raise RuntimeError("Locust wrote no counts:\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
        counts = json.loads(counts_path.read_text())
        report["requests"] = {k: counts[k] for k in ("sent", "completed", "cancelled", "rejected", "failed",
                                                      "in_flight")}
        report["requests"]["output_tokens"] = counts["output_tokens"]
        report["requests"]["stop_missed"] = counts["stop_missed"]
        report["requests"]["interrupted_at_quit"] = counts.get("interrupted_at_quit", 0)
        report["interrupted"] = counts.get("interrupted", [])
        report["by_user"] = counts["by_user"]
        report["failures"] = counts["failures"]
        # The server should go idle at once: cancelled requests free their blocks within a step.
        deadline = time.monotonic() + 30
        idle = None
        while time.monotonic() < deadline:
            s = sampler.sample()
            if s and s["kv_used"] == 0 and s["running"] == 0 and s["waiting"] == 0:
                idle = s
                break
            time.sleep(0.2)
        last = sampler.samples[-1] if sampler.samples else {}
        # A request Locust itself left behind as it quit (rare: a user still mid-request when the
        # quitting event fires) was cut off by the client. It counts as cancelled only if the
        # server then went idle with every block back, i.e. the server did end it; else it stays
        # "in flight" and the check fails.
        abandoned = counts.get("live_at_quit", [])
        report["requests"]["abandoned_at_quit"] = len(abandoned)
        report["abandoned"] = abandoned
        if abandoned and idle is not None:
            report["requests"]["cancelled"] += len(abandoned)
            report["requests"]["in_flight"] -= len(abandoned)
        report["kv_blocks_used_end"] = last.get("kv_used")
        report["idle_after_s"] = round(idle["t"] - load_end, 2) if idle else None
        sampler.stop()
        report["memory"] = memory_windows(sampler.samples, load_start, load_end)
        report["peak_kv_blocks_used"] = max((s["kv_used"] or 0) for s in sampler.samples)
        report["samples"] = sampler.samples
        report["stats_csv"] = str(workdir / "locust_stats.csv")
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        server.stop()
    report["checks"] = checks(report)
    report["passed"] = all(ok for ok, _ in report["checks"].values())
    return report


def checks(report: dict) -> dict[str, tuple[bool, str]]:
    r = report["requests"]
    mem = report["memory"]
    growth = mem.get("growth")
    return {
        "no_failures": (r["failed"] == 0, f"{r['failed']} requests failed that were not cancelled"),
        "all_accounted": (r["in_flight"] == 0 and r["completed"] + r["cancelled"] + r["rejected"] + r["failed"]
                          == r["sent"], f"{r['sent']} sent = {r['completed']} completed + {r['cancelled']} "
                          f"cancelled + {r['rejected']} rejected + {r['failed']} failed, {r['in_flight']} in flight"),
        "did_work": (r["completed"] > 0, f"{r['completed']} completed"),
        "kv_blocks_freed": (report["kv_blocks_used_end"] == 0, f"{report['kv_blocks_used_end']} KV blocks used at the end"),
        "memory_bounded": (growth is not None and growth < GROWTH_LIMIT,
                           f"resident memory {mem.get('start_mb')} -> {mem.get('end_mb')} MiB "
                           f"({growth if growth is None else f'{growth:+.1%}'}; limit +{GROWTH_LIMIT:.0%})"),
    }


def summary(report: dict) -> str:
    r, mem = report["requests"], report["memory"]
    lines = [
        f"soak: {report['duration_s']:.0f}s, {report['users']} users (2 x max_num_seqs {report['max_num_seqs']}), "
        f"{report['cancel_share']:.0%} cancelled at random, max_tokens <= {report['max_tokens']}",
        f"  requests   sent {r['sent']}, completed {r['completed']}, cancelled {r['cancelled']}, "
        f"rejected {r['rejected']}, failed {r['failed']}, in flight at the end {r['in_flight']} "
        f"({r['output_tokens']} output tokens; {r.get('abandoned_at_quit', 0)} cut off as Locust quit)",
        f"  KV blocks  used at the end {report['kv_blocks_used_end']} (peak {report.get('peak_kv_blocks_used')}); "
        f"idle {report.get('idle_after_s')}s after the load stopped",
        f"  memory     tritonserver + stub {mem.get('start_mb')} MiB (first {mem.get('window_s')}s) -> "
        f"{mem.get('end_mb')} MiB (last {mem.get('window_s')}s), peak {mem.get('peak_mb')} MiB",
        f"  server CPU {report.get('server_cpu_s')} s during the load; glibc mmap threshold "
        f"{report.get('malloc_mmap_threshold') or 'dynamic (default)'}",
    ]
    for name, (ok, text) in report["checks"].items():
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {name}: {text}")
    for failure in report.get("failures", [])[:5]:
        lines.append(f"  failure: {failure}")
    for item in report.get("abandoned", [])[:5]:
        lines.append(f"  cut off by Locust's own shutdown: {item}")
    lines.append("soak: PASSED" if report["passed"] else "soak: FAILED")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.load.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="the server's max_num_seqs (default 8)")
    p.add_argument("--users", type=int, default=None, help="Locust users (default 2 x max_num_seqs)")
    p.add_argument("--cancel", type=float, default=0.1, help="share of requests cancelled part-way (0.1)")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each request's output length (64)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config.pbtxt parameter for the soak server (repeatable)")
    p.add_argument("--model-repository", type=Path, default=None)
    p.add_argument("--model-path", default=None, help="checkpoint folder (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--malloc-mmap-threshold", type=int, default=MMAP_THRESHOLD, metavar="BYTES",
                   help=f"glibc's mmap threshold in the server (default {MMAP_THRESHOLD}: resident "
                        "memory follows live memory; 0: glibc's own dynamic threshold)")
    p.add_argument("--json", type=Path, default=None, help="write the whole report (samples included)")
    args = p.parse_args(argv)
    params = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--param needs KEY=VALUE; got {item!r}")
        params[key] = value
    if args.duration <= 0 or args.duration > 3600:
        p.error("--duration must be in (0, 3600] seconds")
    report = run(duration=args.duration, max_num_seqs=args.max_num_seqs, users=args.users, cancel=args.cancel,
                 max_tokens=args.max_tokens, params=params, model_repository=args.model_repository,
                 model_path=args.model_path, seed=args.seed, malloc_mmap_threshold=args.malloc_mmap_threshold)
    print(summary(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
