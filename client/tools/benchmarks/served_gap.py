"""The served path against the in-process engine, one interleaved run (issue 47's must-show).

    python -m client.tools.benchmarks.served_gap --model-path models/smollm2-135m-instruct-q4_1 \\
        [--prompts 3400,512] [--decode 128] [--rounds 1] [--threads N] [--server-threads N] \\
        [--param KEY=VALUE ...] [--json FILE]

One tritonserver (`inflight serve`'s launcher, the rendered default config, free loopback ports) with
the OpenAI port beside it, and one AsyncEngine in this process (the engine model.py builds) from the
same parameters, resolved as the model resolves them (instance_config.engine_config). Three arms:
`in_process` (add_request and its callbacks), `http` (Triton's generate_stream, token ids in) and
`openai` (/v1/completions through the official openai SDK, streaming), timed A B C C B A per round so
a shared machine's drift hits all alike. Each arm's turn runs, on fresh random token ids (no prefix
reuse between turns):
- `ttft_<L>`: one prompt of L tokens, one output token: send to first token (s);
- `decode`: a 32-token prompt, --decode tokens (ignore_eos): ms per output token after the first.
Beside each figure: the engine process's threads that worked (CPU seconds over 2% of the wall, and
their cores), its minor page faults, and the CPU of tritonserver, the OpenAI server and this process as the client. First it
prints what the served engine logged at start (TritonServer.engine_reports: EngineConfig, CPU team,
OpenMP environment) beside the in-process engine's; last, the summary (medians, served / in-process,
as JSON and as a table). --threads sets OMP_NUM_THREADS for both engines, --server-threads for the
server alone (unlike settings on purpose, as issue 47's first figures were; 0: the default).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[3]
DECODE_PROMPT = 32


def served_config(params: dict[str, str], model_path: str):
    """The EngineConfig model.py builds on a CPU instance of the rendered default config with these
    parameters set (what start_local_server serves)."""
    from templates.render import read_parameters, render
    spec = importlib.util.spec_from_file_location(
        "instance_config", ROOT / "model_repository" / "llm" / "1" / "instance_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.engine_config({**read_parameters(render(gpus=[])), **params, "model_path": model_path}, "CPU", 0, ROOT)


def start_server(model_path: str, params: dict[str, str], env: dict[str, str]):
    """A tritonserver on free loopback ports serving the rendered default CPU config with `params`
    (as `inflight bench --compare-server` starts one), in environment `env`."""
    import tempfile

    from serving.triton_launcher import TritonServer
    from templates.render import write_config

    repo = Path(tempfile.mkdtemp(prefix="inflight-gap-repo-"))
    write_config(repo / "llm" / "config.pbtxt", gpus=[])
    (repo / "llm" / "1").symlink_to(ROOT / "model_repository" / "llm" / "1", target_is_directory=True)
    server = TritonServer(repo, params=params, model_path=model_path, env=env).start()
    try:
        server.wait_ready(600)
    except BaseException:
        server.stop()
        raise
    return server


def config_differences(served: dict, local: dict) -> dict:
    return {k: [served.get(k), local.get(k)] for k in sorted(set(served) | set(local)) if served.get(k) != local.get(k)}


def thread_cpu_seconds(pid: int, thread) -> float:
    """A thread's CPU seconds: the kernel's schedstat run time in nanoseconds where it has one, else
    psutil's user + system time, counted in clock ticks (10 ms: a short figure's work, a tiny model's
    TTFT, read as 0 or 0.01 s, and a summary's CPU ratio went missing where the base read 0)."""
    try:
        with open(f"/proc/{pid}/task/{thread.id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return thread.user_time + thread.system_time


class Threads:
    """CPU seconds per thread of a set of processes, between two snapshots."""

    def __init__(self, pids: Sequence[int]):
        import psutil
        self.procs = [psutil.Process(p) for p in pids]

    def snap(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for p in self.procs:
            for t in p.threads():
                out[t.id] = thread_cpu_seconds(p.pid, t)
        return out

    def minor_faults(self) -> int:
        """The processes' minor page faults so far (/proc/<pid>/stat's 10th field): memory touched for
        the first time, tens of microseconds a page in some VMs."""
        total = 0
        for p in self.procs:
            with open(f"/proc/{p.pid}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[7])
        return total

    @staticmethod
    def busy(before: dict, after: dict, wall: float) -> list:
        """[[cpu_s, cores], ...] of the threads that worked more than 2% of `wall`."""
        rows = []
        for tid, cpu in after.items():
            used = cpu - before.get(tid, 0.0)
            if used > 0.02 * wall:
                try:
                    cores = sorted(os.sched_getaffinity(tid))
                except OSError:
                    cores = []
                rows.append([round(used, 3), cores])
        return sorted(rows, reverse=True)


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process; "client": this process's (the served arms' client)."""
    import psutil
    out = {"client": time.process_time()}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[name] = t.user + t.system
    return out


# -- one request per arm: (send, first token, last token, output tokens) --------------------------
def in_process(engine) -> Callable:
    from backend.core.sampling_params import SamplingParams
    count = iter(range(10**9))

    def once(ids: list[int], max_tokens: int) -> tuple:
        times, done = [], threading.Event()

        def on_output(out) -> None:
            if out.new_token_ids:
                times.append(time.monotonic())
            if out.finished:
                times.append(len(out.token_ids))
                done.set()
        t0 = time.monotonic()
        engine.add_request(f"gap-{next(count)}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True), on_output)
        if not done.wait(3600):
            raise TimeoutError("the in-process engine did not answer")
        return t0, times[0], times[-2], times[-1]
    return once


def http(url: str) -> Callable:
    from client.http_client import HttpClient
    client = HttpClient(url)

    def once(ids: list[int], max_tokens: int) -> tuple:
        t0, stamps, n = time.monotonic(), [], 0
        for chunk in client.stream(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                   exclude_input_in_output=True):
            if chunk.token_ids:
                stamps.append(chunk.time)
                n += len(chunk.token_ids)
        return t0, stamps[0], stamps[-1], n
    return once


def openai_sdk(base_url: str) -> Callable:
    from openai import OpenAI
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=3600)
    model = client.models.list().data[0].id

    def once(ids: list[int], max_tokens: int) -> tuple:
        t0, stamps, n = time.monotonic(), [], 0
        stream = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for event in stream:
            if event.choices and event.choices[0].text:
                stamps.append(time.monotonic())
            if event.usage is not None:
                n = event.usage.completion_tokens
        return t0, stamps[0], stamps[-1], n
    return once


def figures(once: Callable, prompts: Sequence[int], decode: int, vocab: int, rng, watch: Callable) -> dict:
    """One arm's turn: ttft_<L> for each prompt length, then decode; each with its threads."""
    out = {}
    for name, length, max_tokens in [*((f"ttft_{n}", n, 1) for n in prompts), ("decode", DECODE_PROMPT, decode)]:
        ids = rng.integers(3, vocab, length).tolist()
        before = watch()
        t0, first, last, n = once(ids, max_tokens)
        after = watch()
        value = first - t0 if max_tokens == 1 else 1000 * (last - first) / max(1, n - 1)
        wall = (last if max_tokens > 1 else first) - t0
        other = {k: round(after[1][k] - before[1][k], 3) for k in after[1]} if after[1] else {}
        out[name] = {"value": round(value, 4), "tokens": n, "threads": Threads.busy(before[0], after[0], wall),
                     "other_cpu_s": other, "minor_faults": after[2] - before[2]}
    return out


def summary(turns: list[dict], arms: Sequence[str]) -> dict:
    names = list(turns[0]["figures"])
    table = {}
    for name in names:
        med = {a: statistics.median(t["figures"][name]["value"] for t in turns if t["arm"] == a) for a in arms}
        base = arms[0]  # in_process unless --arms says otherwise
        row = {a: round(v, 6) for a, v in med.items()}
        row.update({f"{a}/{base}": round(med[a] / med[base], 3) for a in arms[1:]})
        # the CPU seconds of the engine's process (its threads over 2% of the wall): what a loaded
        # machine's waits do not inflate as much as the wall time
        cpu = {a: statistics.median(sum(x[0] for x in t["figures"][name]["threads"]) for t in turns if t["arm"] == a)
               for a in arms}
        row.update({f"cpu_{a}": round(v, 3) for a, v in cpu.items()})
        row.update({f"cpu_{a}/{base}": round(cpu[a] / cpu[base], 3) for a in arms[1:] if cpu[base]})
        table[name] = row
    return table


def markdown(table: dict, arms: Sequence[str]) -> str:
    """The summary as docs/performance.md's table rows: each figure's base median, then the other
    arms' wall and CPU ratios over it."""
    base, rest = arms[0], arms[1:]
    head = ["figure", base, *(f"{a} / {base}" for a in rest), *(f"CPU {a} / {base}" for a in rest)]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name, row in table.items():
        cells = [name, f"{row[base]:.4g}", *(f"{row[f'{a}/{base}']:.2f}x" for a in rest),
                 *(f"{row[f'cpu_{a}/{base}']:.2f}x" if f"cpu_{a}/{base}" in row else "-" for a in rest)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--prompts", default="3400,512")
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both engines")
    p.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the server only (0: unset, the engine's default)")
    p.add_argument("--arms", default="in_process,http,openai", help="the first is the base of the ratios")
    p.add_argument("--param", action="append", default=[], help="a config.pbtxt parameter, KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.threads is not None:  # before torch loads here, and inherited by tritonserver's stub
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
    server_env = dict(os.environ)
    if a.server_threads == 0:  # the server's own default (cpu_affinity.cpu_threads: every core but one)
        server_env.pop("OMP_NUM_THREADS", None)
    elif a.server_threads is not None:
        server_env["OMP_NUM_THREADS"] = str(a.server_threads)
    import numpy as np

    from backend.engine.async_engine import AsyncEngine
    from client.tools.load.soak import server_processes
    from kernels.cpuinfo import cpu_model
    from serving.openai_launcher import OpenAIServer

    params = dict(kv.split("=", 1) for kv in a.param)
    model_path = str(Path(a.model_path).resolve())
    arms = a.arms.split(",")
    head = {"command": " ".join(sys.argv), "cpu": cpu_model(), "start": datetime.now(timezone.utc).isoformat(),
            "load_average": os.getloadavg(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "server_OMP_NUM_THREADS": server_env.get("OMP_NUM_THREADS")}
    print(json.dumps(head), flush=True)
    server = start_server(model_path, params, server_env)
    api = None
    try:
        api = OpenAIServer(server.grpc_url, model_path, metrics_url=server.metrics_url).start() if "openai" in arms else None
        config = served_config(params, model_path)
        engine = AsyncEngine(config)
        report = server.engine_reports()[0]
        root, stubs = server_processes(server.process.pid)
        stub = next(s.pid for s in stubs if any(Path(x).parent.parent.name == "llm" for x in s.cmdline()))
        others = {"tritonserver": root.pid, **({"openai_server": api.process.pid} if api else {})}
        check = {"config_differences": config_differences(report["config"], dataclasses.asdict(config)),
                 "served_cpu_placement": report["cpu_placement"], "in_process_cpu_placement": engine.cpu_placement,
                 "served_env": report["env"], "served_frozen_objects": report["frozen_objects"]}
        print(json.dumps(check), flush=True)
        runners = {"in_process": in_process(engine), "http": http(server.http_url),
                   "openai": openai_sdk(api.url) if api else None}
        watchers = {"in_process": (Threads([os.getpid()]), None), "http": (Threads([stub]), others),
                    "openai": (Threads([stub]), others)}
        rng = np.random.default_rng(a.seed)
        prompts = [int(n) for n in a.prompts.split(",")]
        for arm in arms:  # warm-up: each path once, untimed
            runners[arm](rng.integers(3, engine.vocab_size, 16).tolist(), 2)
        turns = []
        for _ in range(a.rounds):
            for arm in arms + arms[::-1]:
                threads, other = watchers[arm]
                watch = lambda: (threads.snap(), cpu_of(other) if other else {}, threads.minor_faults())  # noqa: E731
                turn = {"arm": arm, "load_average": os.getloadavg(),
                        "figures": figures(runners[arm], prompts, a.decode, engine.vocab_size, rng, watch)}
                turns.append(turn)
                print(json.dumps(turn), flush=True)
        engine.shutdown()
    finally:
        if api is not None:
            api.stop()
        server.stop()
    result = {**head, **check, "end": datetime.now(timezone.utc).isoformat(), "load_average_end": os.getloadavg(),
              "summary": summary(turns, arms), "turns": turns}
    print(json.dumps({"summary": result["summary"], "load_average_end": result["load_average_end"]}), flush=True)
    print(markdown(result["summary"], arms), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
