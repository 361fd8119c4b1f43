"""A digest of the scheduler's decisions over seeded random workloads: two checkouts whose digests
match scheduled the same rows, preemptions and reservations at every step of every run.

    python -m client.tools.benchmarks.sched_trace --runs 600                      # this checkout
    python -m client.tools.benchmarks.sched_trace --runs 600 --code /tmp/before   # and another one

Each run draws a policy (no-evict twice as often), a batching mode (in-flight three times as
often as static or dynamic), prefix caching (40%), block size, budget, cache size, requests with
n of 1 or 2 and priorities -1..1, arrivals, aborts (3% a step) and EOS (3% a token). No model.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence


def run(seed: int) -> str:
    import backend
    from backend.kv.block_manager import BlockManager
    from backend.core.config import EngineConfig
    from backend.core.sampling_params import SamplingParams
    from backend.core.request import Request
    if (Path(backend.__file__).parent / "sched").is_dir():
        from backend.sched.factory import make_scheduler
        from backend.core.step import Sampled
    else:  # before scheduling became a package
        from backend.core.outputs import Sampled
        from backend.scheduler import make_scheduler

    rng = random.Random(seed)
    policy = rng.choice(["guaranteed_no_evict", "guaranteed_no_evict", "max_utilization"])
    mode = rng.choice(["inflight", "inflight", "inflight", "static", "dynamic"])
    reuse = rng.random() < 0.4
    bs, max_seqs = rng.choice([1, 4, 16]), rng.randint(1, 8)
    cfg = EngineConfig(model_path="unused", kv_block_size=bs, max_num_batched_tokens=max(rng.randint(9, 120), max_seqs + 1),
                       max_num_seqs=max_seqs, batch_scheduler_policy=policy, batching_mode=mode,
                       enable_kv_cache_reuse=reuse, max_queue_delay_microseconds=0)
    sched = make_scheduler(cfg, BlockManager(rng.randint(8, 48), bs, enable_prefix_caching=reuse), 10_000)
    shared = [rng.randrange(1, 100) for _ in range(40)]
    pending = []
    for i in range(rng.randint(1, 30)):
        p, m = rng.randint(1, 60), rng.randint(1, 60)
        head = shared[:rng.randint(0, p)] if reuse else []
        r = Request(f"r{i}", head + [rng.randrange(1, 100) for _ in range(p - len(head))],
                    SamplingParams(max_tokens=m, temperature=0, n=rng.choice([1, 1, 1, 2])), (0,), arrival_time=0.0,
                    priority=rng.randint(-1, 1))
        try:
            sched.check_fits(p, m, r.params.n)
        except ValueError:
            continue
        pending.append(r)
    digest = hashlib.sha256()
    for step in range(3000):
        while pending and rng.random() < 0.4:
            r = pending.pop(0)
            for q in [r] + [Request(r.request_id, r.prompt_token_ids, r.params, (0,), 0.0, priority=r.priority, index=k)
                            for k in range(1, r.params.n)]:
                sched.add(q)
        if rng.random() < 0.03:
            ids = [q.request_id for q in sched.iter_requests()]
            if ids:
                sched.abort(rng.choice(ids))
        out = sched.schedule(float(step))
        reservation = None if sched.reservation is None else tuple(sched.reservation)
        digest.update(repr(([(s.request.seq_id, s.start, s.num_new_tokens) for s in out.seqs + out.padding],
                            [q.seq_id for q in out.preempted], reservation)).encode())
        sched.postprocess(out, {s.request.seq_id: Sampled(0 if rng.random() < 0.03 else 7)
                                for s in out.seqs if s.samples}, float(step))
        if hasattr(sched, "deliver"):
            sched.deliver([])  # padded batches release their members here
        elif hasattr(sched, "pop_released"):
            sched.pop_released()
        if not pending and not sched.has_work:
            break
    return digest.hexdigest()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.sched_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=600)
    p.add_argument("--code", action="append", default=[], help="another checkout (repeatable)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(hashlib.sha256("".join(run(s) for s in range(args.runs)).encode()).hexdigest()[:16])
        return 0
    digests = {}
    for code in [Path(__file__).resolve().parents[3]] + [Path(c).resolve() for c in args.code]:
        out = subprocess.run([sys.executable, __file__, "--one", "--runs", str(args.runs)], cwd=code,
                             env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True, check=True)
        digests[code] = out.stdout.strip()
        print(f"{digests[code]}  {code}")
    return 0 if len(set(digests.values())) == 1 else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
