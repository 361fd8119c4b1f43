"""The engine thread's host time per decode step, and how much of it is making text, measured against
another version of the engine in interleaved runs.

    python -m client.tools.benchmarks.host_step --model-path DIR [--batches 1,16,64] [--steps 40]
    python -m client.tools.benchmarks.host_step --model-path DIR --before REF [--rounds 3]   # REF's engine too
    python -m client.tools.benchmarks.host_step --model-path DIR --streams 64               # the served engine

Host time: B requests decode while the model's forward pass and LM head are replaced by stubs that
return at once (zeros, and a fixed random logits table of the real vocabulary), so a step's time is
everything but the model: scheduling, the step plan or inputs, the block tables, sampling (the
argmax over the vocabulary stays), the update, and making the outputs. Two figures per batch size:
`engine_ms`, the engine thread's share (LLMEngine.core_step where the engine has one; the whole
step before detokenizing left the engine thread), and `step_ms`, LLMEngine.step() whole (the offline
API, which makes text on the caller's thread). `detok_ms`: the time in the incremental detokenizer
per step, on the stepping thread.

`--streams N`: N streaming requests through the threaded engine the server runs (AsyncEngine) on
the real model; per step, the engine thread's time and the detokenizer's time on each thread.

`--before REF` runs this file against git REF's engine too (its tree, extracted to a temporary
folder), in separate processes A B B A per round, and prints the medians side by side. Only the
public API and `engine.runner.model` are used, so any version since the Python API existed runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

PROMPT_TOKENS = 100


def _stub_model(engine, rows: int) -> None:
    import torch
    model = engine.runner.model
    cfg = model.cfg
    table = torch.randn(rows, cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    model.forward = lambda ids, positions, ctx, rope, **kw: torch.zeros(ids.shape[0], cfg.hidden_size)
    model.logits = lambda hidden: table[:hidden.shape[0]]  # (plain greedy rows: the sampler reads it only)


class _DetokClock:
    """Time spent in the incremental detokenizer, per thread name."""

    def __init__(self):
        from backend.text import detokenizer
        self.spent: dict[str, float] = {}
        cls = detokenizer.IncrementalDetokenizer
        add = cls.add

        def timed(det, ids):
            t0 = time.perf_counter()
            try:
                return add(det, ids)
            finally:
                name = threading.current_thread().name
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t0
        cls.add = timed


def _decoding_engine(model_path: str, batch: int, steps: int):
    from backend import LLM, SamplingParams
    llm = LLM(model_path, max_num_seqs=max(batch, 8), max_model_len=PROMPT_TOKENS + 4 * steps + 64,
              cpu_kv_cache_tokens=max(batch, 8) * (PROMPT_TOKENS + 4 * steps + 64))
    engine = llm.engine
    params = SamplingParams(max_tokens=4 * steps + 32, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    reqs = [engine.add_request(f"h{i}", [3 + (7 * i + 13 * j) % (vocab - 3) for j in range(PROMPT_TOKENS)], params)
            for i in range(batch)]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    return llm, engine


def measure_steps(model_path: str, batches: list[int], steps: int) -> list[dict]:
    rows = []
    for batch in batches:
        llm, engine = _decoding_engine(model_path, batch, steps)
        _stub_model(engine, max(batch, 8) * 8)
        for _ in range(3):
            engine.step()
        clock = _DetokClock()
        core = getattr(engine, "core_step", None)
        figures = {}
        for name, fn in (("engine", core or engine.step), ("step", engine.step)):
            clock.spent.clear()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            figures[name] = 1e3 * statistics.median(times)
            figures[f"{name}_detok"] = 1e3 * sum(clock.spent.values()) / steps
        rows.append({"batch": batch, "engine_ms": figures["engine"], "step_ms": figures["step"],
                     "engine_detok_ms": figures["engine_detok"], "step_detok_ms": figures["step_detok"],
                     "engine_has_core_step": core is not None})
        llm.close()
    return rows


def measure_streams(model_path: str, streams: int, tokens: int) -> dict:
    """`streams` streaming requests through AsyncEngine on the real model: the engine thread's time
    per step and the detokenizer's time per step on each thread."""
    from backend import EngineConfig, SamplingParams
    try:
        from backend.engine.async_engine import AsyncEngine
    except ImportError:  # versions before the packages by layer
        from backend.async_engine import AsyncEngine
    clock = _DetokClock()
    eng = AsyncEngine(EngineConfig(model_path=model_path, max_num_seqs=streams,
                                   cpu_kv_cache_tokens=streams * (PROMPT_TOKENS + tokens + 32)))
    inner = eng.engine
    name = "core_step" if hasattr(inner, "core_step") else "step"
    step = getattr(inner, name)
    times = []

    def timed():
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        return out
    setattr(inner, name, timed)
    done = threading.Event()
    left = [streams]
    lock = threading.Lock()

    def on_output(o):
        if o.finished:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    vocab = inner.model_config.vocab_size
    for i in range(streams):
        eng.add_request(f"s{i}", [3 + (7 * i + 13 * j) % (vocab - 3) for j in range(PROMPT_TOKENS)], params, on_output)
    done.wait(600)
    eng.shutdown()
    decode = times[len(times) // 4:]  # the decode phase (the prompts' steps first)
    n = len(times)
    return {"streams": streams, "steps": n, "engine_step_ms": 1e3 * statistics.median(decode),
            "detok_ms_per_step": {k: 1e3 * v / n for k, v in clock.spent.items()}}


def compare(ref: str, argv: list[str], rounds: int) -> int:
    from client.tools.benchmarks.interleave import ab_runs
    print(json.dumps(summary(ab_runs(ref, "client.tools.benchmarks.host_step", argv, rounds)), indent=1))
    return 0


def summary(results: dict) -> dict:
    table = {}
    for who, runs in results.items():
        for run in runs:
            for row in run.get("rows", []):
                for key in ("engine_ms", "step_ms", "engine_detok_ms"):
                    table.setdefault(f"B={row['batch']}", {}).setdefault(f"{who}_{key}", []).append(row[key])
            if "streams" in run:
                s = run["streams"]
                table.setdefault("streams", {}).setdefault(f"{who}_engine_step_ms", []).append(s["engine_step_ms"])
                table["streams"].setdefault(f"{who}_engine_thread_detok_ms", []).append(
                    s["detok_ms_per_step"].get("inflight-engine", 0.0))
    return {k: {m: round(statistics.median(v), 3) for m, v in row.items()} | (
        {"engine_ms ratio before/after": round(statistics.median(row["before_engine_ms"]) /
                                               statistics.median(row["after_engine_ms"]), 2)}
        if "before_engine_ms" in row and "after_engine_ms" in row else {}) for k, row in table.items()}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.host_step", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--streams", type=int, default=0, help="also N streams through AsyncEngine (the real model)")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--json", type=Path)
    p.add_argument("--before", metavar="REF", help="compare with the engine at git REF (interleaved runs)")
    p.add_argument("--rounds", type=int, default=1, help="with --before: rounds of A B B A")
    args = p.parse_args(argv)
    if args.before:
        return compare(args.before, ["--model-path", args.model_path, "--batches", args.batches, "--steps",
                                     str(args.steps), "--streams", str(args.streams), "--stream-tokens",
                                     str(args.stream_tokens)], args.rounds)
    report = {"model": args.model_path, "rows": measure_steps(args.model_path, [int(b) for b in args.batches.split(",")],
                                                                args.steps)}
    if args.streams:
        report["streams"] = measure_streams(args.model_path, args.streams, args.stream_tokens)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
