"""`inflight bench --goodput`: the highest Poisson request rate a running server sustains within a
latency SLO, and the instances a target load needs.

    # against `make serve` (gRPC; --protocol http: Triton's generate_stream; --protocol openai
    # --url localhost:9000: /v1/completions of any OpenAI-compatible server)
    inflight bench --goodput --url localhost:8001 --slo-ttft-p99 2 --slo-itl-p99 0.2 --target-rpm 2000

SLO: time-to-first-token p99 <= --slo-ttft-p99 and inter-token p99 <= --slo-itl-p99 (seconds, as the
client sees them), and no failed request. Each rate is one bounded run of the seeded workload
(client/tools/benchmarks/workloads.py) at Poisson arrivals: about --duration seconds of arrivals
(at least --min-requests requests), every request sent when it arrives (open loop), measured and
summed up as `inflight bench` does (client/tools/benchmarks/targets.py, measure.py).

The search: from --rate, doubling while the SLO is met, or halving while it is not, until one rate
meets it and one does not (the bracket); then bisection of the bracket until its ends are within
--tolerance of each other or --max-runs rates were measured. The goodput is the highest rate that met
the SLO below the lowest that missed it; instances needed = ceil(target rate / goodput). Latency
grows with the rate, so the search assumes that a rate above one that missed misses too; a noisy
machine can break that, so read the table of runs.

The exit code is 1 when no rate met the SLO, or every request of a run (or of the warm-up) failed
(the errors are printed: the server refuses these requests at any rate); 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

# -- the SLO and the search (no I/O: tests/test_goodput.py drives them with a synthetic server) ---------


@dataclass(frozen=True)
class SLO:
    ttft_p99_s: float
    itl_p99_s: float

    def misses(self, result: dict[str, Any]) -> list[str]:
        """Why a run's result misses the SLO; empty when it meets it."""
        out = []
        if result.get("failed"):
            out.append(f"{result['failed']} failed")
        for key, bound, name in (("ttft_p99_s", self.ttft_p99_s, "TTFT p99"),
                                 ("itl_p99_s", self.itl_p99_s, "ITL p99")):
            value = result.get(key)
            if value is None:
                out.append(f"no {name} measured")
            elif value > bound:
                out.append(f"{name} {value * 1000:.0f} > {bound * 1000:.0f} ms")
        return out


@dataclass
class Search:
    """The rates measured, in order, and what came of them."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    best: Optional[float] = None      # highest rate that met the SLO
    lowest_miss: Optional[float] = None

    @property
    def goodput_rps(self) -> float:
        return self.best or 0.0


def find_goodput(measure: Callable[[float], dict[str, Any]], slo: SLO, *, start: float, max_runs: int = 8,
                 tolerance: float = 0.1, min_rate: float = 0.01, max_rate: float = 1e4,
                 factor: float = 2.0) -> Search:
    """Bracket, then bisect, the highest rate (requests/s) whose run `measure(rate)` meets `slo`,
    measuring at most `max_runs` rates. Rates are clamped to [min_rate, max_rate]."""
    if not (0 < min_rate <= start <= max_rate) or max_runs < 1 or tolerance <= 0 or factor <= 1:
        raise ValueError("need 0 < min_rate <= start <= max_rate, max_runs >= 1, tolerance > 0, factor > 1")
    search = Search()

    def run(rate: float) -> bool:
        result = measure(rate)
        misses = slo.misses(result)
        search.runs.append({"rate": rate, "meets_slo": not misses, "misses": misses, **result})
        if misses:  # the search never measures above a rate that missed, nor below one that met
            search.lowest_miss = rate if search.lowest_miss is None else min(search.lowest_miss, rate)
        else:
            search.best = rate if search.best is None else max(search.best, rate)
        return not misses

    rate = start
    # the bracket: one rate that meets the SLO and one that misses it
    while len(search.runs) < max_runs:
        if run(rate):
            if search.lowest_miss is not None or rate >= max_rate:
                break
            rate = min(rate * factor, max_rate)
        else:
            if search.best is not None or rate <= min_rate:
                break
            rate = max(rate / factor, min_rate)
    # bisection between them
    while (len(search.runs) < max_runs and search.best is not None and search.lowest_miss is not None
           and search.lowest_miss - search.best > tolerance * search.best):
        run((search.best + search.lowest_miss) / 2)
    return search


def instances_needed(target_rpm: float, goodput_rps: float) -> Optional[int]:
    """Instances (servers like this one) for `target_rpm` requests a minute: ceil(target / goodput);
    None when no rate met the SLO."""
    if goodput_rps <= 0:
        return None
    return max(1, math.ceil(target_rpm / (goodput_rps * 60.0) - 1e-9))


# -- against a running server ------------------------------------------------------------------------
class _AllFailed(RuntimeError):
    """Every request of a run failed: the server refuses them (a wrong model, a missing output),
    which no rate would change; the search stops."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inflight bench --goodput", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001",
                   help="the server: gRPC host:port (default localhost:8001), Triton HTTP host:port with "
                        "--protocol http, an OpenAI-compatible host:port with --protocol openai")
    p.add_argument("--protocol", choices=("grpc", "http", "openai"), default="grpc")
    p.add_argument("--metrics-url", help="Prometheus endpoint for KV usage (default: the url's host, port 8002)")
    p.add_argument("--slo-ttft-p99", type=float, default=2.0, metavar="S",
                   help="time-to-first-token p99 bound, seconds (default 2)")
    p.add_argument("--slo-itl-p99", type=float, default=0.2, metavar="S",
                   help="inter-token latency p99 bound, seconds (default 0.2)")
    p.add_argument("--target-rpm", type=float, default=2000.0,
                   help="the load to size for, requests a minute (default 2000, the seed article's)")
    p.add_argument("--rate", type=float, default=1.0, help="first rate tried, requests/s (default 1)")
    p.add_argument("--min-rate", type=float, default=0.05)
    p.add_argument("--max-rate", type=float, default=1000.0)
    p.add_argument("--max-runs", type=int, default=8, help="rates measured at most (default 8)")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="stop bisecting when the bracket's ends are this close, relative (default 0.1)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds of arrivals per rate (default 30); the run lasts until the last answer")
    p.add_argument("--min-requests", type=int, default=20, help="requests per rate at least (default 20)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (default none: open loop)")
    p.add_argument("--workload", default="mixed", help="fixed | mixed | hol | FILE.jsonl (default mixed)")
    p.add_argument("--fixed-prompt-len", type=int, default=128)
    p.add_argument("--fixed-output-len", type=int, default=64)
    p.add_argument("--max-output-len", type=int, default=None, help="cap every output length")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="untimed requests before the first rate (default 2)")
    p.add_argument("--json", type=Path, help="write the runs, the goodput and the instances needed here")
    p.add_argument("--no-progress", action="store_true")
    return p


def _table(search: Search) -> str:
    rows = ["  rate/s   req/min  requests  TTFT p99 ms  ITL p99 ms  failed  SLO"]
    for r in search.runs:
        ms = lambda v: f"{v * 1000:11.1f}" if v is not None else f"{'-':>11}"  # noqa: E731
        rows.append(f"{r['rate']:8.3f} {r['rate'] * 60:9.1f} {r['num_requests']:9d} {ms(r['ttft_p99_s'])} "
                    f"{ms(r['itl_p99_s'])[1:]} {r['failed']:7d}  "
                    + ("met" if r["meets_slo"] else "missed: " + "; ".join(r["misses"])))
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from client.tools.benchmarks.report import machine
    from client.tools.benchmarks.targets import ServerTarget
    from client.tools.benchmarks.workloads import WorkItem, make_workload, summary

    args = build_parser().parse_args(argv)
    slo = SLO(args.slo_ttft_p99, args.slo_itl_p99)
    if min(args.slo_ttft_p99, args.slo_itl_p99, args.target_rpm, args.duration) <= 0 or args.min_requests < 1:
        print("inflight bench --goodput: the SLO bounds, --target-rpm, --duration and --min-requests must be "
              "positive", file=sys.stderr)
        return 2
    if not args.min_rate <= args.rate <= args.max_rate:
        print("inflight bench --goodput: need --min-rate <= --rate <= --max-rate", file=sys.stderr)
        return 2
    progress = not args.no_progress and sys.stderr.isatty()

    def workload(rate: Optional[float], n: int) -> list[WorkItem]:
        return make_workload(args.workload, n, seed=args.seed, rate=rate, prompt_format=args.prompt_format,
                             fixed_prompt_len=args.fixed_prompt_len, fixed_output_len=args.fixed_output_len,
                             max_output_len=args.max_output_len)

    try:
        probe = workload(None, args.min_requests)
    except ValueError as exc:
        print(f"inflight bench --goodput: {exc}", file=sys.stderr)
        return 2
    target = ServerTarget(args.url, args.protocol, args.metrics_url)
    started = _dt.datetime.now().astimezone()
    if args.warmup > 0:  # untimed: first-call costs out of the way
        longest = sorted(probe, key=lambda w: -w.prompt_len)[:args.warmup]
        warm = target.run([WorkItem(i, w.prompt, w.prompt_len, min(4, w.max_tokens)) for i, w in enumerate(longest)],
                          len(longest))
        if not warm["completed"]:
            print(f"inflight bench --goodput: every warm-up request failed: {'; '.join(warm['errors'])}",
                  file=sys.stderr)
            return 1

    def measure(rate: float) -> dict[str, Any]:
        items = workload(rate, max(args.min_requests, math.ceil(rate * args.duration)))
        result = target.run(items, args.max_concurrency or len(items), progress)
        if not result["completed"]:  # not a latency: a server that refuses these requests at any rate
            raise _AllFailed(f"every request at {rate:.3f}/s failed: {'; '.join(result['errors'])}")
        met = "met" if not slo.misses(result) else "missed"
        print(f"  rate {rate:.3f}/s: {len(items)} requests, TTFT p99 "
              f"{(result['ttft_p99_s'] or float('nan')) * 1000:.0f} ms, ITL p99 "
              f"{(result['itl_p99_s'] or float('nan')) * 1000:.0f} ms, failed {result['failed']}: SLO {met}",
              file=sys.stderr, flush=True)
        return result

    try:
        search = find_goodput(measure, slo, start=args.rate, max_runs=args.max_runs, tolerance=args.tolerance,
                              min_rate=args.min_rate, max_rate=args.max_rate)
    except KeyboardInterrupt:
        print("inflight bench --goodput: interrupted", file=sys.stderr)
        return 1
    except _AllFailed as exc:
        print(f"inflight bench --goodput: {exc}", file=sys.stderr)
        return 1
    needed = instances_needed(args.target_rpm, search.goodput_rps)
    print()
    print(f"{target.name} ({target.mode}); SLO: TTFT p99 <= {slo.ttft_p99_s * 1000:.0f} ms, "
          f"ITL p99 <= {slo.itl_p99_s * 1000:.0f} ms, no failures")
    print(_table(search))
    print()
    if search.best is None:
        print(f"goodput: no rate met the SLO (lowest tried {min(r['rate'] for r in search.runs):.3f}/s)")
    else:
        bracket = (f"{search.lowest_miss:.3f}/s missed" if search.lowest_miss
                   else "a lower bound: no rate tried missed; raise --max-runs or --rate")
        print(f"goodput: {search.best:.3f} requests/s ({search.best * 60:.0f}/min; {bracket})")
        print(f"instances needed for {args.target_rpm:.0f} requests/min: {needed}")
    if args.json:
        meta = {"date": started.isoformat(timespec="seconds"), "machine": machine(),
                "command": "inflight bench --goodput " + " ".join(sys.argv[2:] if argv is None else argv),
                "target": target.name, "mode": target.mode, "workload": args.workload, "seed": args.seed,
                "workload_summary": summary(probe)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "meta": meta, "slo": {"ttft_p99_s": slo.ttft_p99_s, "itl_p99_s": slo.itl_p99_s},
            "goodput_rps": search.best, "goodput_rpm": search.best * 60 if search.best else None,
            "lowest_missed_rps": search.lowest_miss, "target_rpm": args.target_rpm,
            "instances_needed": needed, "runs": search.runs}, indent=2))
    return 0 if search.best is not None else 1
