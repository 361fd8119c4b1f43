"""Strict no-evict admission against backfill, on the head-of-line workload, in one run.

    python -m client.tools.benchmarks.backfill --model-path models/default --num-requests 64 --repeats 2

Each target is one in-process `LLMEngine` (`enable_backfill` false, then true; alternating A B B A
over the repeats), fed the whole `hol` workload at once (client/tools/benchmarks/workloads.py: a large
`max_tokens` every 8th request) and stepped to the end. Reported per target: the small requests'
TTFT p50/p99 (arrival to first token), throughput, preemptions, and for every request that was a
blocked head its admission step against its reservation (the step by which it was promised to
start; backfill.py). The KV cache is sized so that one large request fits at a time.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from client.tools.benchmarks.workloads import HOL, make_workload


def run_once(model_path: str, backfill: bool, items, kv_tokens: int, block_size: int) -> dict:
    from backend.core.config import EngineConfig
    from backend.engine.llm_engine import LLMEngine
    from backend.core.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model_path=model_path, enable_backfill=backfill, max_num_seqs=32,
                                    max_tokens_in_paged_kv_cache=kv_tokens, kv_block_size=block_size))
    sched = engine.scheduler
    large = {f"r{w.index}" for w in items if w.max_tokens >= HOL["large_output"]}
    start = time.perf_counter()
    for w in items:
        engine.add_request(f"r{w.index}", w.prompt, SamplingParams(max_tokens=w.max_tokens, temperature=0,
                                                                    ignore_eos=True))
    first: dict[str, float] = {}
    first_step: dict[str, int] = {}  # the same in engine steps: free of the machine's noise
    admitted: dict[str, int] = {}
    reservation: dict[str, int] = {}
    tokens = 0
    while engine.has_work():
        waiting = {r.seq_id for r in sched.waiting}
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.new_token_ids:
                first.setdefault(out.request_id, time.perf_counter() - start)
                first_step.setdefault(out.request_id, sched.steps)
        for r in sched.running:
            if r.seq_id in waiting:
                admitted[r.seq_id] = sched.steps
        if sched.reservation is not None:
            sid, at = sched.reservation
            reservation[sid] = min(reservation.get(sid, at), at)
    wall = time.perf_counter() - start
    small = [first[k] for k in first if k not in large]
    small_steps = [first_step[k] for k in first_step if k not in large]
    heads = {k: {"admitted_step": admitted[k], "reservation_step": v} for k, v in reservation.items()}
    return {"backfill": backfill, "wall_s": wall, "output_tok_s": tokens / wall,
            "small_ttft_p50_ms": 1e3 * float(np.percentile(small, 50)),
            "small_ttft_p99_ms": 1e3 * float(np.percentile(small, 99)),
            "small_ttft_p50_steps": float(np.percentile(small_steps, 50)),
            "small_ttft_p99_steps": float(np.percentile(small_steps, 99)),
            "large_ttft_ms": sorted(1e3 * first[k] for k in large),
            "preemptions": sched.num_preemptions, "backfilled": sched.num_backfilled, "steps": sched.steps,
            "heads": heads, "late_heads": sorted(k for k, h in heads.items()
                                                 if h["admitted_step"] > h["reservation_step"])}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.backfill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="each target this many times, A B B A ...")
    p.add_argument("--kv-tokens", type=int, default=1024, help="KV cache size (one large request fits at a time)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    items = make_workload("hol", args.num_requests, seed=args.seed)
    order = []
    for i in range(args.repeats):
        order += [False, True] if i % 2 == 0 else [True, False]
    runs = [run_once(args.model_path, b, items, args.kv_tokens, args.block_size) for b in order]
    print(f"{'admission':<10} {'tok/s':>8} {'small TTFT p50':>15} {'small TTFT p99':>15} {'(in steps)':>13} "
          f"{'preempt':>8} {'backfilled':>10} {'heads':>6} {'late':>5}")
    for r in runs:
        print(f"{'backfill' if r['backfill'] else 'strict':<10} {r['output_tok_s']:>8.0f} "
              f"{r['small_ttft_p50_ms']:>12.0f} ms {r['small_ttft_p99_ms']:>12.0f} ms "
              f"{r['small_ttft_p50_steps']:>6.0f}/{r['small_ttft_p99_steps']:<6.0f} {r['preemptions']:>8} "
              f"{r['backfilled']:>10} {len(r['heads']):>6} {len(r['late_heads']):>5}")
    mean = lambda b, k: float(np.mean([r[k] for r in runs if r["backfill"] is b]))
    ratio = mean(False, "small_ttft_p99_ms") / mean(True, "small_ttft_p99_ms")
    steps = mean(False, "small_ttft_p99_steps") / mean(True, "small_ttft_p99_steps")
    print(f"small-request TTFT p99, strict / backfill: {ratio:.1f}x in time, {steps:.1f}x in steps; "
          f"throughput backfill / strict: {mean(True, 'output_tok_s') / mean(False, 'output_tok_s'):.2f}x")
    if args.output_json:
        args.output_json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "runs": runs, "ttft_p99_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
