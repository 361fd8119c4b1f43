"""The seed's three latency claims, measured in-process (AsyncEngine) on one CPU (issue 45, Build item 4).

    python -m client.tools.benchmarks.seed_claims max-seqs     --model-path models/smollm2-135m-instruct-q4_1
    python -m client.tools.benchmarks.seed_claims long-prompts --model-path models/smollm2-135m-instruct-q4_1
    python -m client.tools.benchmarks.seed_claims goodput      --model-path models/smollm2-135m-instruct-q4_1

Each writes JSON (docs/bench/seed_<claim>.json), a plot (docs/seed_<claim>.png) and a markdown table with
its verdict (docs/bench/seed_<claim>.md); `--out-dir` and the sizes are flags.

- max-seqs: the same seeded Poisson workload (`--rate`) run once per `max_num_seqs`, with the KV cache
  fixed at `--kv-tokens` so that large batches compete for it; TTFT / inter-token p50 and p99 as
  `inflight bench` measures them (targets.InProcessTarget, measure.summarize), with the KV usage,
  running and waiting requests and preemptions sampled every 50 ms.
- long-prompts: `--streams` streams decode while prompts of `--lengths` tokens arrive one at a time,
  per config: unchunked, chunks of `--chunks` tokens with pacing off, the default pacing. Measured
  as pacing.py measures them (pacing.Tracker): the streams' gaps that end while the prompt is on its
  way to its first token (at most `--window-s`; a prompt still without one then is aborted, cut).
- goodput: per batching mode, goodput.find_goodput's search of the highest Poisson rate meeting the
  SLO (`--slo-ttft-p99`, `--slo-itl-p99`, no failed request); each rate one bounded run (`--duration`
  s of arrivals, unanswered requests aborted `--drain-s` later and counted failed); instances for
  `--target-rpm` = ceil(target / goodput). static and dynamic answer once, at the batch's end: their
  TTFT is the whole answer's time and they have no inter-token gap, so only the TTFT bound binds them.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from client.tools.benchmarks.goodput import SLO, find_goodput, instances_needed
from client.tools.benchmarks.measure import _pct
from client.tools.benchmarks.seed_report import markdown, plot
from client.tools.benchmarks.step_probe import _ints
from templates.render import parse_param

CLAIMS = ("max-seqs", "long-prompts", "goodput")
ANSWER_ONCE = ("static", "dynamic")  # no inter-token gaps: the whole answer at the batch's end


def chunk_configs(chunks: Sequence[int], max_model_len: int) -> dict[str, dict[str, Any]]:
    """long-prompts' configs: engine overrides by name (the default pacing last)."""
    configs: dict[str, dict[str, Any]] = {"unchunked": {"enable_chunked_context": False, "inter_token_target_ms": 0.0,
                                                        "max_num_batched_tokens": max_model_len}}
    for c in chunks:
        configs[f"chunk {c}"] = {"max_num_batched_tokens": c, "inter_token_target_ms": 0.0}
    configs["paced (default)"] = {}
    return configs


def window_stats(gaps: Sequence[float]) -> dict[str, Any]:
    return {"itl_p50_s": _pct(gaps, 50), "itl_p99_s": _pct(gaps, 99), "itl_max_s": max(gaps) if gaps else None,
            "gaps": len(gaps)}


def slo_result(mode: str, result: dict[str, Any]) -> dict[str, Any]:
    """A run's result as the SLO reads it: a mode that answers once has no gaps, which meet any ITL bound."""
    if mode in ANSWER_ONCE and result.get("itl_p99_s") is None and result.get("completed"):
        return {**result, "itl_p99_s": 0.0, "itl_note": "answers once: no inter-token gap"}
    return result


# -- the three runs (each takes a target factory, so tests drive them without an engine) -------------------
def run_max_seqs(args, make_target: Callable[[str, dict], Any]) -> list[dict]:
    from client.tools.benchmarks.workloads import make_workload
    items = make_workload(args.workload, args.num_requests, seed=args.seed, rate=args.rate, vocab_size=args.vocab,
                          max_output_len=args.max_output_len)
    rows = []
    for n in args.max_seqs:
        target = make_target("inflight", {"max_num_seqs": n, "max_tokens_in_paged_kv_cache": args.kv_tokens,
                                          **args.extra})
        try:
            warm(target, items)
            r = target.run(items, len(items), timeout=args.drain_s)
        finally:
            target.close()
        rows.append({"max_num_seqs": n, **r})
        say(f"max_num_seqs {n}: TTFT p99 {_pm(r['ttft_p99_s'])} ms, ITL p99 {_pm(r['itl_p99_s'])} ms, "
            f"KV peak {r.get('kv_usage_peak')}, waiting mean {r.get('waiting_mean')}, failed {r['failed']}")
    return rows


def run_goodput(args, make_target: Callable[[str, dict], Any]) -> list[dict]:
    from client.tools.benchmarks.workloads import make_workload
    slo, rows = SLO(args.slo_ttft_p99, args.slo_itl_p99), []
    for mode in args.modes:
        target = make_target(mode, {"max_num_seqs": args.batch, **args.extra})
        try:
            warm(target, make_workload(args.workload, 4, seed=args.seed, vocab_size=args.vocab,
                                       max_output_len=args.max_output_len))

            def measure(rate: float) -> dict[str, Any]:
                n = max(args.min_requests, math.ceil(rate * args.duration))
                items = make_workload(args.workload, n, seed=args.seed, rate=rate, vocab_size=args.vocab,
                                      max_output_len=args.max_output_len)
                r = slo_result(mode, target.run(items, len(items), timeout=args.drain_s))
                say(f"{mode} {rate:.3f}/s: {n} requests, TTFT p99 {_pm(r['ttft_p99_s'])} ms, ITL p99 "
                    f"{_pm(r['itl_p99_s'])} ms, failed {r['failed']}: {slo.misses(r) or 'met'}")
                return r

            search = find_goodput(measure, slo, start=args.rate, max_runs=args.max_runs, tolerance=args.tolerance,
                                  min_rate=args.min_rate)
        finally:
            target.close()
        rows.append({"mode": mode, "goodput_rps": search.best, "lowest_missed_rps": search.lowest_miss,
                     "instances": instances_needed(args.target_rpm, search.goodput_rps), "runs": search.runs})
    return rows


def warm(target, items) -> None:
    """Untimed: the first long shapes and allocations paid before the clock starts."""
    from client.tools.benchmarks.workloads import WorkItem
    longest = sorted(items, key=lambda w: -w.prompt_len)[:2]
    target.run([WorkItem(i, w.prompt, w.prompt_len, min(4, w.max_tokens)) for i, w in enumerate(longest)], 2)


def run_long_prompts(args, make_engine: Callable[[dict], Any]) -> list[dict]:
    from client.tools.benchmarks.pacing import Tracker, prompt_of
    rows = []
    for name, overrides in chunk_configs(args.chunks, args.max_model_len).items():
        engine = make_engine({"max_model_len": args.max_model_len, **overrides, **args.extra})
        try:
            rng, t = random.Random(args.seed), Tracker()
            t.add(engine, "warm", prompt_of(rng, 64, engine.vocab_size), 4)
            t.done["warm"].wait()
            streams = [f"s{i}" for i in range(args.streams)]
            for rid in streams:  # decode until aborted at the end
                t.add(engine, rid, prompt_of(rng, args.stream_prompt, engine.vocab_size),
                      args.max_model_len - args.stream_prompt - 1)
            while any(len(t.times[r]) < 8 for r in streams):
                time.sleep(0.01)
            for n in args.lengths:
                quiet_from = time.perf_counter()
                time.sleep(args.quiet_s)
                quiet = t.gaps(streams, quiet_from, time.perf_counter())
                rid = f"long{n}"
                t.add(engine, rid, prompt_of(rng, n, engine.vocab_size), 1)
                cut = not t.done[rid].wait(args.window_s)
                if cut:
                    engine.abort(rid)
                end = t.times[rid][0] if t.times[rid] else time.perf_counter()
                row = {"config": name, "prompt_tokens": n, **window_stats(t.gaps(streams, t.started[rid], end)),
                       "quiet_itl_p99_s": _pct(quiet, 99), "ttft_s": None if cut else t.ttft(rid), "cut": cut,
                       "waited_s": end - t.started[rid]}
                rows.append(row)
                say(f"{name}, {n} tokens: ITL p99 {_pm(row['itl_p99_s'])} ms (quiet {_pm(row['quiet_itl_p99_s'])}), "
                    f"TTFT {row['ttft_s']}")
            for rid in streams:
                engine.abort(rid)
        finally:
            engine.shutdown()
    return rows


# -- command line -------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.seed_claims", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("claim", choices=CLAIMS)
    p.add_argument("--model-path", default="models/smollm2-135m-instruct-q4_1")
    p.add_argument("--out-dir", type=Path, default=Path("docs"),
                   help="writes OUT/bench/seed_<claim>.json and .md, OUT/seed_<claim>.png (default docs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param", type=parse_param, action="append", default=[], metavar="KEY=VALUE",
                   help="more engine parameters (config.pbtxt keys)")
    w = p.add_argument_group("max-seqs and goodput: the workload")
    w.add_argument("--workload", default="mixed")
    w.add_argument("--max-output-len", type=int, default=64)
    w.add_argument("--rate", type=float, default=None, help="Poisson rate, req/s (max-seqs: 4; goodput: the first tried, 1)")
    w.add_argument("--drain-s", type=float, default=None,
                   help="seconds after the last arrival before what is unanswered is aborted (max-seqs 60, goodput 20)")
    m = p.add_argument_group("max-seqs")
    m.add_argument("--max-seqs", type=_ints, default=[8, 16, 32, 64, 128, 256])
    m.add_argument("--num-requests", type=int, default=60)
    m.add_argument("--kv-tokens", type=int, default=2048,
                   help="KV cache size in tokens (max_tokens_in_paged_kv_cache): ~11 mixed requests' budgets")
    lp = p.add_argument_group("long-prompts")
    lp.add_argument("--lengths", type=_ints, default=[2048, 4096, 8100])
    lp.add_argument("--chunks", type=_ints, default=[128, 512, 2048])
    lp.add_argument("--streams", type=int, default=4)
    lp.add_argument("--stream-prompt", type=int, default=37)
    lp.add_argument("--max-model-len", type=int, default=8192)
    lp.add_argument("--quiet-s", type=float, default=2.0, help="seconds of decoding measured before each prompt")
    lp.add_argument("--window-s", type=float, default=60.0, help="longest wait for a prompt's first token")
    g = p.add_argument_group("goodput")
    g.add_argument("--modes", default="none,static,dynamic,inflight")
    g.add_argument("--batch", type=int, default=64, help="max_num_seqs (and the static batch) of every mode")
    g.add_argument("--slo-ttft-p99", type=float, default=2.0)
    g.add_argument("--slo-itl-p99", type=float, default=0.2)
    g.add_argument("--target-rpm", type=float, default=2000.0)
    g.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    g.add_argument("--min-requests", type=int, default=12)
    g.add_argument("--max-runs", type=int, default=4, help="rates measured per mode at most")
    g.add_argument("--tolerance", type=float, default=0.25)
    g.add_argument("--min-rate", type=float, default=0.05)
    return p


def as_params(overrides: dict[str, Any]) -> dict[str, str]:
    """Engine overrides as config.pbtxt strings (EngineConfig.from_params parses and checks them)."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _pm(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from client.tools.benchmarks.report import machine
    args = build_parser().parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.extra = dict(args.param)
    if args.rate is None:
        args.rate = 4.0 if args.claim == "max-seqs" else 1.0
    if args.drain_s is None:
        args.drain_s = 60.0 if args.claim == "max-seqs" else 20.0
    if not Path(args.model_path).is_dir():
        say(f"seed_claims: --model-path {args.model_path} is not a folder (`make model` fetches the default)")
        return 2
    from backend.models.loader import load_model_config
    args.vocab = load_model_config(args.model_path).vocab_size
    started = _dt.datetime.now(_dt.timezone.utc)
    load = [os.getloadavg()[0]]
    if args.claim == "long-prompts":
        from backend.core.config import EngineConfig
        from backend.engine.async_engine import AsyncEngine
        rows = run_long_prompts(args, lambda o: AsyncEngine(EngineConfig.from_params(as_params(o),
                                                                                     model_path=args.model_path)))
    else:
        from client.tools.benchmarks.targets import InProcessTarget
        make = lambda mode, params: InProcessTarget(args.model_path, mode, as_params(params))  # noqa: E731
        rows = (run_max_seqs if args.claim == "max-seqs" else run_goodput)(args, make)
    load.append(os.getloadavg()[0])
    meta = {"claim": args.claim, "date": f"{started:%Y-%m-%d %H:%M}-{_dt.datetime.now(_dt.timezone.utc):%H:%M} UTC",
            "machine": machine(), "load": f"{min(load):.1f}-{max(load):.1f}", "target_rpm": args.target_rpm,
            "command": "python -m client.tools.benchmarks.seed_claims " + " ".join(sys.argv[1:] if argv is None else argv),
            "slo": {"ttft_p99_s": args.slo_ttft_p99, "itl_p99_s": args.slo_itl_p99}}
    stem = "seed_" + args.claim.replace("-", "_")
    (args.out_dir / "bench").mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench" / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    text = markdown(args.claim, rows, meta)
    (args.out_dir / "bench" / f"{stem}.md").write_text(text)
    plot(args.claim, rows, args.out_dir / f"{stem}.png", f"{args.claim}: {meta['machine']}, {meta['date']}, "
                                                          f"load {meta['load']}")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
