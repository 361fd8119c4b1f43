"""What a busy neighbour on the other core costs the engine's single-stream decode (issue 47's served gap).

    python -m client.tools.benchmarks.neighbour --model-path models/smollm2-135m-instruct-q4_1 \\
        [--decode 128] [--rounds 2] [--repeats 3] [--cpu N] [--json FILE]

Served, the engine shares the machine with tritonserver, the stub's responder and the OpenAI server;
on a 2-vCPU VM those run on the other vCPU, which may be the same physical core's second thread or
share its L3 and memory bandwidth. This tool tells how much such a neighbour alone costs: one
AsyncEngine in this process (the served default config, served_gap.served_config), its decode timed
(`--decode` tokens after a 32-token prompt, ms a token after the first, the median of `--repeats`)
while another process pinned to CPU `--cpu` (default: the last this process may use) is
- ``idle``: none;
- ``spin``: a Python busy loop (the core's pipelines and its power state);
- ``stream``: numpy copying 256 MB arrays (the shared L3 and memory bandwidth),
in the order idle spin stream stream spin idle each round, so a drifting machine hits all alike.
Each turn records its decodes' wall time, the neighbour's CPU seconds since it started a second
before them (proof it ran beside them) and the load average; the summary is
each kind's median and its ratio to idle's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

KINDS = ("idle", "spin", "stream")
WORK = {"spin": "while True:\n    pass\n",
        "stream": "import numpy as np\na = np.ones(32 << 20)\nb = np.empty_like(a)\n"
                  "while True:\n    np.copyto(b, a)\n"}  # 256 MB each way (float64)


def start(kind: str, cpu: int) -> Optional[subprocess.Popen]:
    """The neighbour of `kind`, pinned to `cpu`, once it runs; None for idle."""
    if kind == "idle":
        return None
    proc = subprocess.Popen([sys.executable, "-c", WORK[kind]], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    time.sleep(1.0)  # started, and numpy's arrays touched
    return proc


def summary(turns: list[dict]) -> dict:
    med = {k: statistics.median(t["decode_ms"] for t in turns if t["kind"] == k) for k in KINDS}
    return {k: {"median_ms": round(med[k], 4), "vs_idle": round(med[k] / med["idle"], 4)} for k in KINDS}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="decodes a turn (their median)")
    p.add_argument("--cpu", type=int, default=None, help="the neighbour's CPU (default: the last one allowed)")
    p.add_argument("--param", action="append", default=[], help="a config.pbtxt parameter, KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import numpy as np

    from backend.engine.async_engine import AsyncEngine
    from client.tools.benchmarks.served_gap import DECODE_PROMPT, cpu_of, in_process, served_config
    from kernels.cpuinfo import cpu_model

    cpu = a.cpu if a.cpu is not None else max(os.sched_getaffinity(0))
    engine = AsyncEngine(served_config(dict(kv.split("=", 1) for kv in a.param), str(Path(a.model_path).resolve())))
    head = {"command": " ".join(sys.argv), "cpu": cpu_model(), "start": datetime.now(timezone.utc).isoformat(),
            "neighbour_cpu": cpu, "engine_cpu_placement": engine.cpu_placement, "load_average": os.getloadavg()}
    print(json.dumps(head), flush=True)
    once, rng, turns = in_process(engine), np.random.default_rng(a.seed), []
    try:
        once(rng.integers(3, engine.vocab_size, 16).tolist(), 4)  # warm-up, untimed
        for _ in range(a.rounds):
            for kind in KINDS + KINDS[::-1]:
                proc = start(kind, cpu)
                try:
                    values, t0 = [], time.monotonic()
                    for _ in range(a.repeats):
                        _, first, last, n = once(rng.integers(3, engine.vocab_size, DECODE_PROMPT).tolist(), a.decode)
                        values.append(1000 * (last - first) / max(1, n - 1))
                    turn = {"kind": kind, "decode_ms": round(statistics.median(values), 4),
                            "values": [round(v, 4) for v in values],
                            "wall_s": round(time.monotonic() - t0, 3), "neighbour_cpu_s": round(cpu_of({"n": proc.pid})["n"] if proc else 0.0, 3),
                            "load_average": os.getloadavg()}
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
                turns.append(turn)
                print(json.dumps(turn), flush=True)
    finally:
        engine.shutdown()
    result = {**head, "end": datetime.now(timezone.utc).isoformat(), "summary": summary(turns), "turns": turns}
    print("| neighbour | decode ms/token (median) | vs idle |\n| --- | ---: | ---: |")
    for k, v in result["summary"].items():
        print(f"| {k} | {v['median_ms']:.3f} | {v['vs_idle']:.3f}x |")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
