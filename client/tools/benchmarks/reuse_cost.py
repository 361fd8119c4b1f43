"""What prefix reuse costs a workload with nothing to reuse (docs/performance.md, "Prefix reuse by default").

    python -m client.tools.benchmarks.reuse_cost --json /tmp/reuse-cost.json      # SmolLM2, 32 mixed requests

The `mixed` workload (client/tools/benchmarks/workloads.py: random token ids, so no two prompts share a
block) runs through `LLM.generate` on two engines in this process, `enable_kv_cache_reuse` true
and false, turn and turn about (A B B A ...; `--repeats` runs each). Each pair of runs draws its
own workload (seed, seed + 1, ...): a prompt seen by an earlier run would be a prefix hit. Reported per setting: the
output tokens/s of every run and their median, the ratio of the medians (reuse / no reuse), the
prefix hits (none expected) and whether every output is the same token for token; per pair the
ratio of the two runs (back to back, so the machine's load drifts least between them) and the
engine process's CPU time per token. And the same workloads through the scheduler and block
manager alone (no model, best of 3): the host time prefix caching adds, which is all it adds when
nothing matches (a sha256 per full block while a request waits and as its blocks fill, a
dictionary entry per block).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from backend import LLM, EngineConfig, SamplingParams
from client.tools.benchmarks.kv_tiers import DEFAULT_MODEL
from client.tools.benchmarks.workloads import make_workload
from templates.render import parse_param


def scheduling_cost(reuse: bool, prompts: list, params: list, repeats: int = 3) -> float:
    """Seconds the scheduler and block manager take for the whole workload with no model (every
    row samples token 7): what prefix caching adds on the host, free of the model's noise."""
    from backend.kv.block_manager import BlockManager
    from backend.core.request import Request
    from backend.sched.factory import make_scheduler
    from backend.core.step import Sampled

    best = float("inf")
    for _ in range(repeats):
        cfg = EngineConfig(model_path="unused", enable_kv_cache_reuse=reuse)
        sched = make_scheduler(cfg, BlockManager(4096, 16, enable_prefix_caching=reuse), 4096)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            sched.add(Request(f"r{i}", prompt, p, arrival_time=0.0))
        start = time.perf_counter()
        while sched.has_work:
            out = sched.schedule(0.0)
            sched.postprocess(out, {s.request.seq_id: Sampled(7) for s in out.seqs if s.samples}, 0.0)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.reuse_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=6, help="pairs of runs (each its own workload)")
    p.add_argument("--param", type=parse_param, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--first", choices=("reuse", "no_reuse"), default="reuse",
                   help="which engine is built first (the first-built one ran ~3%% more CPU per token here, "
                        "whatever its setting: compare a run of each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    extra = EngineConfig.typed_overrides(dict(args.param))
    built = (True, False) if args.first == "reuse" else (False, True)
    engines = {reuse: LLM(args.model_path, enable_kv_cache_reuse=reuse, **extra) for reuse in built}
    vocab = engines[True].engine.vocab_size
    runs = {True: [], False: []}
    cpu = {True: [], False: []}
    same, host, total_tokens = True, {True: 0.0, False: 0.0}, 0
    for r in range(args.repeats):
        items = make_workload("mixed", args.num_requests, seed=args.seed + r, vocab_size=vocab)
        prompts = [item.prompt for item in items]
        params = [SamplingParams(max_tokens=min(item.max_tokens, args.max_output_len), temperature=0,
                                 ignore_eos=True) for item in items]
        outputs = {}
        for reuse in ((True, False) if r % 2 == 0 else (False, True)):
            start, cpu_start = time.perf_counter(), time.process_time()
            outs = engines[reuse].generate(prompts, params)
            seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
            tokens = sum(len(o.token_ids) for o in outs)
            runs[reuse].append(tokens / seconds)
            cpu[reuse].append(cpu_s / tokens * 1e3)
            host[reuse] += scheduling_cost(reuse, prompts, params)
            outputs[reuse] = [o.token_ids for o in outs]
            print(f"run {r}, reuse={reuse}: {runs[reuse][-1]:.1f} tok/s", file=sys.stderr, flush=True)
        same = same and outputs[True] == outputs[False]
        total_tokens += sum(p.max_tokens for p in params)
    hits = {reuse: llm.stats()["prefix_cache_hit_tokens"] for reuse, llm in engines.items()}
    pairs = [a / b for a, b in zip(runs[True], runs[False])]
    report = {
        "command": " ".join(["python -m client.tools.benchmarks.reuse_cost"] + list(argv or sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "tokens_per_s": {"reuse": runs[True], "no_reuse": runs[False]},
        "ratio_per_pair": pairs, "median_ratio_per_pair": statistics.median(pairs),
        "median_ratio_reuse_over_no_reuse": statistics.median(runs[True]) / statistics.median(runs[False]),
        "cpu_ms_per_token": {"reuse": cpu[True], "no_reuse": cpu[False]},
        "median_cpu_ms_per_token_ratio": statistics.median(cpu[True]) / statistics.median(cpu[False]),
        "scheduling_s_no_model": {"reuse": host[True], "no_reuse": host[False]},
        "scheduling_us_added_per_output_token": 1e6 * (host[True] - host[False]) / total_tokens,
        "prefix_cache_hit_tokens": {"reuse": hits[True], "no_reuse": hits[False]},
        "outputs_equal": same,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    for llm in engines.values():
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
