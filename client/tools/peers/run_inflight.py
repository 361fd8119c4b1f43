"""inflight's runner for the peer comparison: LLM.generate on the whole workload (see __init__)."""
from __future__ import annotations

import sys
import time

from client.tools.peers.common import load_workload, parse_runner_args, write_result


def main() -> int:
    args = parse_runner_args(sys.argv[1:])
    from backend import LLM, SamplingParams
    items = load_workload(args.workload)
    longest = max(len(p) for p, _ in items)
    llm = LLM(args.model_path, dtype="float32", max_model_len=max(longest + 600, 2048))
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([p for p, _ in items[:args.warmup]], [greedy(4)] * min(args.warmup, len(items)))
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in items], [greedy(n) for _, n in items])
    elapsed = time.perf_counter() - t0
    write_result(args.out, "inflight", elapsed, [len(o.token_ids) for o in outs], items)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
