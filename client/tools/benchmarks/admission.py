"""The cost of one admission pass under overload: the scheduler alone (no model), its KV cache full
of running requests, and 1,000 waiting requests that do not fit, so that backfill tries every one
of them at every step.

    python -m client.tools.benchmarks.admission                      # this checkout
    python -m client.tools.benchmarks.admission --code /tmp/before   # interleaved with another checkout

Setup: 4,096 blocks of 16 tokens, max_num_seqs 256, a budget of 8,192 tokens; 128 running requests
(256-token prompts, max_tokens 256: 32 blocks each, the whole cache reserved) decoding; then
`--waiting` requests (300-token prompts, max_tokens 200) that cannot start until the running
ones finish. Reported per checkout: the median `schedule()` time over `--steps` steps with the
waiting requests and without them (the difference is the admission pass), and the milliseconds
per waiting request. `--code` runs each checkout in its own interpreter, alternating A B B A.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

HERE = Path(__file__).resolve().parents[3]


def measure(waiting: int, steps: int, reuse: bool) -> dict:
    """In this interpreter: median schedule() ms with and without `waiting` requests queued."""
    from backend.kv.block_manager import BlockManager
    from backend.core.config import EngineConfig
    from backend.core.sampling_params import SamplingParams
    from backend.core.request import Request
    import backend

    if (Path(backend.__file__).parent / "sched").is_dir():
        from backend.sched.factory import make_scheduler
        from backend.core.step import Sampled
    else:  # checkouts before scheduling became a package (the editable install must not mix them)
        from backend.core.outputs import Sampled
        from backend.scheduler import make_scheduler

    def run(n_waiting: int) -> list[float]:
        cfg = EngineConfig(model_path="unused", kv_block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                           enable_kv_cache_reuse=reuse)
        sched = make_scheduler(cfg, BlockManager(4096, 16, enable_prefix_caching=reuse), 4096)
        params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
        for i in range(128):
            sched.add(Request(f"run{i}", [1 + (i * 7 + j) % 1000 for j in range(256)], params, arrival_time=0.0))

        def step() -> float:
            start = time.perf_counter()
            out = sched.schedule(0.0)
            took = time.perf_counter() - start
            sched.postprocess(out, {s.request.seq_id: Sampled(7) for s in out.seqs if s.samples}, 0.0)
            return took

        while len(sched.running) < 128 or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            step()
        wait = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        for i in range(n_waiting):
            sched.add(Request(f"wait{i}", [1 + (i * 13 + j) % 1000 for j in range(300)], wait, arrival_time=0.0))
        times = [step() for _ in range(steps)]
        assert len(sched.waiting) == n_waiting, "a waiting request started: the setup must overload"
        return times

    loaded, idle = run(waiting), run(0)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"waiting": waiting, "schedule_ms": ms(loaded), "schedule_ms_empty_queue": ms(idle),
            "admission_ms": ms(loaded) - ms(idle), "us_per_waiting": 1e3 * (ms(loaded) - ms(idle)) / max(1, waiting)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.admission", description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2, help="runs per checkout, alternating A B B A")
    p.add_argument("--reuse", action="store_true", help="enable_kv_cache_reuse (prefix caching)")
    p.add_argument("--code", action="append", default=[], help="another checkout to measure (repeatable)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure here, print JSON
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.waiting, args.steps, args.reuse)))
        return 0
    checkouts = [HERE] + [Path(c).resolve() for c in args.code]
    order = []
    for i in range(args.repeats):
        order += checkouts if i % 2 == 0 else checkouts[::-1]
    results: dict[Path, list[dict]] = {c: [] for c in checkouts}
    for code in order:
        env = {**os.environ, "PYTHONPATH": str(code)}
        # this file measures every checkout: `backend` comes from the checkout's own folder
        cmd = [sys.executable, __file__, "--one", "--waiting", str(args.waiting),
               "--steps", str(args.steps)] + (["--reuse"] if args.reuse else [])
        out = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, check=True)
        results[code].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'checkout':<40} {'schedule() ms':>14} {'empty queue':>12} {'admission ms':>13} {'us/waiting':>11}")
    for code, runs in results.items():
        med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
        print(f"{str(code)[-40:]:<40} {med('schedule_ms'):>14.2f} {med('schedule_ms_empty_queue'):>12.2f} "
              f"{med('admission_ms'):>13.2f} {med('us_per_waiting'):>11.2f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
