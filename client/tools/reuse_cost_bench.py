"""What prefix reuse costs a workload with nothing to reuse (docs/performance.md, "Prefix reuse by default").

    python -m client.tools.reuse_cost_bench --json /tmp/reuse-cost.json      # SmolLM2, 32 mixed requests

The `mixed` workload (client/tools/workloads.py: random token ids, so no two prompts share a
block) runs through `LLM.generate` on two engines in this process, `enable_kv_cache_reuse` true
and false, turn and turn about (A B B A ...; `--repeats` runs each). Reported per setting: the
output tokens/s of every run and their median, the ratio of the medians (reuse / no reuse), the
prefix hits (none expected) and whether every output is the same token for token. What reuse adds
when nothing matches: a sha256 per full block while a request waits and as its blocks fill, and a
dictionary per block.
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
from client.tools.kv_tiers_bench import DEFAULT_MODEL
from client.tools.workloads import make_workload
from templates.render import parse_param


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.reuse_cost_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=DEFAULT_MODEL)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs per setting")
    p.add_argument("--param", type=parse_param, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    extra = EngineConfig.typed_overrides(dict(args.param))
    engines = {reuse: LLM(args.model_path, enable_kv_cache_reuse=reuse, **extra) for reuse in (True, False)}
    vocab = engines[True].engine.vocab_size
    items = make_workload("mixed", args.num_requests, seed=args.seed, vocab_size=vocab)
    prompts = [item.prompt for item in items]
    params = [SamplingParams(max_tokens=min(item.max_tokens, args.max_output_len), temperature=0, ignore_eos=True)
              for item in items]
    runs = {True: [], False: []}
    outputs = {}
    order = [True, False, False, True] * args.repeats
    for reuse in order[:2 * args.repeats]:
        llm = engines[reuse]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        runs[reuse].append(sum(len(o.token_ids) for o in outs) / seconds)
        outputs[reuse] = [o.token_ids for o in outs]
        print(f"reuse={reuse}: {runs[reuse][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    hits = {reuse: llm.stats()["prefix_cache_hit_tokens"] for reuse, llm in engines.items()}
    report = {
        "command": " ".join(["python -m client.tools.reuse_cost_bench"] + list(argv or sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "tokens_per_s": {"reuse": runs[True], "no_reuse": runs[False]},
        "median_ratio_reuse_over_no_reuse": statistics.median(runs[True]) / statistics.median(runs[False]),
        "prefix_cache_hit_tokens": {"reuse": hits[True], "no_reuse": hits[False]},
        "outputs_equal": outputs[True] == outputs[False],
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
