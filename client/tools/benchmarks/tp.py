"""Tensor parallelism on the CPU: the decode step of one rank with 2 threads against two ranks of 1
thread each (gloo), and the share of the step rank 0 spends in collectives.

    python -m client.tools.benchmarks.tp [--model tiny|mid|smollm2-shape|PATH] [--tp 2] [--batches 1,16]
                                    [--steps 40] [--rounds 3]

Each measurement is its own process (OMP_NUM_THREADS: 2 for one rank, 1 for each of the --tp
ranks, which the workers inherit; and, for reference, one rank of 1 thread); the rounds alternate
the three so all see the same load on a shared machine, and the table gives medians over rounds
and the ratios. `tiny` is the tests' random model (4 layers, hidden 256), `mid` a random
Llama-shaped one (8 layers, hidden 1024, 16 heads, 8 KV heads, MLP 2816), `smollm2-shape` a
random one of SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, 49152 tokens) with 8 heads
of 72 and 2 KV heads instead of 9 and 3, so that it splits in 2 (SmolLM2 itself splits in 3). The collectives' time is rank 0's host clock around each (gloo is
synchronous): all-reduces (two a layer and the embedding's), the logits' all-gather and the step
message; it includes waiting for the slower rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {"tiny": {}, "mid": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                  num_attention_heads=16, num_key_value_heads=8),
          "smollm2-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                                num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True)}
PROMPT_TOKENS = 100

def configs(tp: int) -> tuple[tuple[int, int], ...]:
    """(ranks, threads per rank): the issue's pair, then one rank of one thread."""
    return (1, 2), (tp, 1), (1, 1)


def measure(model: str, tp: int, batch: int, steps: int) -> dict:
    """In this process: the median decode step of `batch` sequences, and the collectives' share."""
    from backend import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, max_model_len=PROMPT_TOKENS + steps + 16, max_num_seqs=batch)
    try:
        engine, group = llm.engine, llm.engine.runner.tp
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        reqs = [engine.add_request(f"b{i}", [3 + (7 * i + j) % 1900 for j in range(PROMPT_TOKENS)], params)
                for i in range(batch)]
        while any(not r.output_token_ids for r in reqs):
            engine.step()
        engine.step()
        before = dict(group.seconds) if group else {}
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        spent = {k: v - before.get(k, 0.0) for k, v in group.seconds.items()} if group else {}
        total = sum(times)
        return dict(tp=tp, batch=batch, threads=int(os.environ.get("OMP_NUM_THREADS", "0")),
                    step_ms=statistics.median(times) * 1e3,
                    all_reduce_share=spent.get("all_reduce", 0.0) / total,
                    collective_share=sum(spent.get(k, 0.0) for k in ("all_reduce", "all_gather", "step_message")) / total)
    finally:
        llm.close()


def run(model: str, tp: int, threads: int, batch: int, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))   # per rank; a worker inherits it
    cmd = [sys.executable, "-m", "client.tools.benchmarks.tp", "--one", str(tp), "--model", model,
           "--batches", str(batch), "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[3])
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.tp", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mid", help="tiny, mid, or a checkpoint folder (default mid)")
    parser.add_argument("--tp", type=int, default=2, help="ranks of the parallel run, 1 thread each (default 2)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)   # a child: one measurement at this TP
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        print(json.dumps(measure(args.model, args.one, batches[0], args.steps)))
        return 0
    with tempfile.TemporaryDirectory(prefix="inflight-tp-bench-") as tmp:
        model = args.model
        if model in SHAPES:
            from backend.models.make_model import make_model
            model = str(make_model(Path(tmp) / model, seed=1, **SHAPES[model]))
        rows = {(tp, t, b): [] for b in batches for tp, t in configs(args.tp)}
        for _ in range(args.rounds):
            for b in batches:
                for tp, t in configs(args.tp):
                    rows[(tp, t, b)].append(run(model, tp, t, b, args.steps))
    print(f"model {args.model}, {args.steps} decode steps after a {PROMPT_TOKENS}-token prompt each, "
          f"{args.rounds} rounds alternating, medians; {time.strftime('%Y-%m-%d %H:%M')}")
    n = args.tp
    print(f"| batch | TP=1, 2 threads: step ms | TP={n}, {n} x 1 thread: step ms | TP={n} / TP=1 (2 threads) | "
          f"all-reduce share (TP={n}) | all collectives share | TP=1, 1 thread: step ms | TP={n} / TP=1 (1 thread) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        med = lambda key, tp, t: statistics.median(r[key] for r in rows[(tp, t, b)])  # noqa: E731
        one, two, single = med("step_ms", 1, 2), med("step_ms", n, 1), med("step_ms", 1, 1)
        print(f"| {b} | {one:.2f} | {two:.2f} | {two / one:.2f}x | {med('all_reduce_share', n, 1):.0%} | "
              f"{med('collective_share', n, 1):.0%} | {single:.2f} | {two / single:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
