"""Tensor-parallel ranks on the C layer stack against the Python layers (issue 47), on the CPU:
decode tok/s and a long prompt's time to first token at TP=N, one thread a rank.

    python -m client.tools.benchmarks.tp_native [--model DIR] [--tp 2] [--batches 1,8] [--steps 40]
                                                [--prompt 1000] [--rounds 3]

Three ways a rank runs its layers, each measured in its own process (its workers inherit the
environment), alternating within each round so all see the same load on a shared machine:
`c`: the C stack, all-reducing in C on the shared memory (kernels/cpu/shm_reduce.py); `callback`:
the C stack calling the group's Python all-reduce back (INFLIGHT_TP_SHM=python); `python`: the
Python layers (INFLIGHT_NATIVE_DECODE=0). Decode: the median step of `batch` sequences after a
100-token prompt each; TTFT: one `--prompt`-token prompt alone, from add_request to its first token.

The default model is SmolLM2-135M Q4_1 (models/smollm2-135m-instruct-q4_1, `make model`) regrouped
for two ranks: its 9 query heads and 3 KV heads of 64 do not split in 2, so its config is rewritten
as 6 heads and 2 KV heads of 96 (the same 576 and 192 columns: the same Q4_1 bytes, the same
GEMMs, the GQA ratio kept; only the attention's head split differs). Its output is not text.
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

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct-q4_1"
WAYS = {"c": {}, "callback": {"INFLIGHT_TP_SHM": "python"}, "python": {"INFLIGHT_NATIVE_DECODE": "0"}}
DECODE_PROMPT = 100


def regrouped(model: Path, out: Path) -> Path:
    """SmolLM2's folder with 6 heads and 2 KV heads of 96 (links to its weights and tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(num_attention_heads=6, num_key_value_heads=2, head_dim=96)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def measure(model: str, tp: int, batch: int, steps: int, prompt: int) -> dict:
    """In this process: the median decode step of `batch` sequences, and one prompt's TTFT."""
    from backend import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, max_model_len=max(prompt, DECODE_PROMPT + steps) + 16,
              max_num_seqs=max(batch, 1), enable_kv_cache_reuse=False)
    try:
        engine, runner = llm.engine, llm.engine.runner
        ranks = runner.decode_path.native_ranks
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        reqs = [engine.add_request(f"b{i}", [3 + (7 * i + j) % 1900 for j in range(DECODE_PROMPT)], params)
                for i in range(batch)]
        while any(not r.output_token_ids for r in reqs):
            engine.step()
        engine.step()
        group = runner.tp
        before = dict(group.seconds), dict(group.calls)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        reduce_s = group.seconds["all_reduce"] - before[0].get("all_reduce", 0.0)
        reduce_n = group.calls["all_reduce"] - before[1].get("all_reduce", 0)
        while engine.has_work():
            engine.step()
        t0 = time.perf_counter()
        req = engine.add_request("long", [3 + (11 * j) % 1900 for j in range(prompt)],
                                 SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while not req.output_token_ids:
            engine.step()
        ttft = time.perf_counter() - t0
        step = statistics.median(times)
        return dict(batch=batch, ranks=ranks, step_ms=step * 1e3, tok_s=batch / step, ttft_s=ttft,
                    all_reduce_share=reduce_s / sum(times), all_reduce_us=1e6 * reduce_s / max(reduce_n, 1))
    finally:
        llm.close()


def run(way: str, model: str, tp: int, batch: int, steps: int, prompt: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", **WAYS[way])
    for key in ("INFLIGHT_TP_SHM", "INFLIGHT_NATIVE_DECODE"):
        if key not in WAYS[way]:
            env.pop(key, None)
    cmd = [sys.executable, "-m", "client.tools.benchmarks.tp_native", "--one", str(tp), "--model", model,
           "--batches", str(batch), "--steps", str(steps), "--prompt", str(prompt)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    if row["ranks"] != [way != "python"] * tp:  # every rank on the path this run is about
        raise RuntimeError(f"{way}: the ranks' C stack {row['ranks']}")
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.tp_native",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a checkpoint folder (default: SmolLM2 Q4_1 regrouped for 2 ranks)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt", type=int, default=1000, help="the TTFT prompt's tokens (default 1000)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one measurement at this TP
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.one:
        print(json.dumps(measure(args.model, args.one, batches[0], args.steps, args.prompt)))
        return 0
    with tempfile.TemporaryDirectory(prefix="inflight-tp-native-") as tmp:
        model = args.model or str(regrouped(DEFAULT_MODEL, Path(tmp) / "smollm2-q4_1-6x96"))
        rows = {(w, b): [] for b in batches for w in WAYS}
        loads = [os.getloadavg()[0]]
        for _ in range(args.rounds):
            for b in batches:
                for way in WAYS:
                    rows[(way, b)].append(run(way, model, args.tp, b, args.steps, args.prompt))
                    loads.append(os.getloadavg()[0])
    if args.json:
        Path(args.json).write_text(json.dumps({f"{w} {b}": r for (w, b), r in rows.items()}, indent=1))
    print(f"model {args.model or 'SmolLM2-135M Q4_1, 6x96 heads'}, TP={args.tp} x 1 thread, {args.steps} decode steps "
          f"after a {DECODE_PROMPT}-token prompt, TTFT of {args.prompt} tokens; {args.rounds} rounds alternating, "
          f"medians; {time.strftime('%Y-%m-%d %H:%M')}; load (1 min) {min(loads):.1f}-{max(loads):.1f}")
    print("| batch | way | decode tok/s | step ms | all-reduce share | per all-reduce us | TTFT s | tok/s vs python "
          "| TTFT vs python |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        med = lambda key, w: statistics.median(r[key] for r in rows[(w, b)])  # noqa: E731
        for w in WAYS:
            print(f"| {b} | {w} | {med('tok_s', w):.1f} | {med('step_ms', w):.2f} | {med('all_reduce_share', w):.0%} | "
                  f"{med('all_reduce_us', w):.0f} | {med('ttft_s', w):.3g} | {med('tok_s', w) / med('tok_s', 'python'):.2f}x | "
                  f"{med('ttft_s', 'python') / med('ttft_s', w):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
