"""`inflight bench`: throughput and latency of the batching modes, in-process or through Triton.

    # every mode, in-process, one engine per mode, a concurrency sweep; JSON + CSV + PNG
    inflight bench --in-process --model-path models/default --mode inflight,static,dynamic,none \\
        --workload mixed --num-requests 128 --concurrency 1,16,64 --output-json bench.json

    # against a running server (gRPC streaming; --protocol http uses generate_stream)
    inflight bench --url localhost:8001 --workload mixed --concurrency 64

    # in-flight in-process and through a local tritonserver, in the same run, with their ratio
    # (--also-no-stream adds the server with one response per request, as a third target)
    inflight bench --compare-server --model-path models/default --concurrency 64 --also-no-stream

    # offline: LLM.generate on the whole workload at once, per mode (no latencies)
    inflight bench --offline --model-path models/default --mode inflight,none

Each (target, mode, concurrency) run sends the same seeded workload (client/tools/benchmarks/workloads.py) with at
most `concurrency` requests in flight (closed loop), or at Poisson arrivals (`--rate`) still capped
by `concurrency`. Times are taken where the client sees them: in-process in the engine's output
callback, through the server when a response arrives. Reported per run: output tokens/s,
requests/s, TTFT / inter-token / end-to-end latency at p50 and p99, KV-cache usage (peak and
mean, sampled every 50 ms: `stats()` in-process, the `inflight_kv_cache_usage_ratio` metric
through the server), preemptions, and failed requests. The static and dynamic modes answer each
request once, when its batch ends, so their TTFT equals their end-to-end latency and they have no
inter-token latency (reported as null). Ratios are always taken within one invocation.

The exit code is 1 when any request failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from client.tools.benchmarks.measure import METRIC_KEYS, MODES
from client.tools.benchmarks.report import _fmt, machine, plot, print_table, ratios, write_csv
from client.tools.benchmarks.targets import InProcessTarget, OfflineTarget, ServerTarget, start_local_server
from client.tools.benchmarks.workloads import DEFAULT_VOCAB_SIZE, make_workload, summary
from templates.render import parse_param

__all__ = ["METRIC_KEYS", "MODES", "machine", "main", "ratios"]


# -- command line ------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be >= 1")
    return values


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(MODES)}; got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inflight bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("where")
    where.add_argument("--in-process", action="store_true", help="run the engine in this process (needs --model-path)")
    where.add_argument("--model-path", help="checkpoint folder for --in-process / --compare-server")
    where.add_argument("--url", help="a running server: gRPC host:port (default localhost:8001), or HTTP with --protocol http")
    where.add_argument("--protocol", choices=("grpc", "http", "openai"), default="grpc",
                       help="openai: an OpenAI-compatible port's /v1/completions (--url localhost:9000)")
    where.add_argument("--no-stream", action="store_true",
                       help="through the server: one response per request (no TTFT/ITL) instead of one per step")
    where.add_argument("--also-no-stream", action="store_true",
                       help="with --compare-server: measure the server both ways in the same run, "
                            "streaming and one response per request")
    where.add_argument("--metrics-url", help="the server's Prometheus endpoint (default: the url's host, port 8002)")
    where.add_argument("--offline", action="store_true",
                       help="LLM.generate on the whole workload at once, per --mode (needs --model-path)")
    where.add_argument("--goodput", action="store_true",
                       help="against a running server: the highest Poisson rate meeting a TTFT/ITL p99 SLO, and "
                            "the instances a target load needs (its options: `inflight bench --goodput --help`)")
    where.add_argument("--compare-server", action="store_true",
                       help="in-flight in-process AND through a server in the same run, with their ratio "
                            "(starts a local tritonserver unless --url is given)")
    what = p.add_argument_group("what")
    what.add_argument("--mode", type=_modes, default=["inflight"],
                      help="in-process: comma list of inflight,static,dynamic,none (one engine each); "
                           "a server reports its own mode")
    what.add_argument("--workload", default="mixed",
                      help="fixed | mixed | hol | extractive | images | embeddings | FILE.jsonl (default mixed); images: "
                           "chat with images (a vision model), embeddings: pooling requests (a pooling model)")
    what.add_argument("--num-requests", type=int, default=128)
    what.add_argument("--concurrency", type=_ints, default=[16], help="requests in flight; a comma list sweeps")
    what.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at once)")
    what.add_argument("--seed", type=int, default=0)
    what.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    what.add_argument("--fixed-prompt-len", type=int, default=128)
    what.add_argument("--fixed-output-len", type=int, default=64)
    what.add_argument("--max-output-len", type=int, default=None, help="cap every output length")
    what.add_argument("--param", type=parse_param, action="append", default=[], metavar="KEY=VALUE",
                      help="engine parameter (config.pbtxt key) for in-process engines and a started server")
    what.add_argument("--speculative-config", metavar="JSON",
                      help="with --in-process: the engine with this speculative_config against the same "
                           "engine without, turn and turn about, with their ratios (client/tools/benchmarks/spec.py)")
    what.add_argument("--warmup", type=int, default=4,
                      help="untimed requests before each target's first run: the workload's longest "
                           "prompts, 4 output tokens each")
    what.add_argument("--repeats", type=int, default=1,
                      help="measure each run this many times, alternating targets (A B B A ...) under "
                           "--compare-server; ratios use the means")
    out = p.add_argument_group("output")
    out.add_argument("--output-json", type=Path)
    out.add_argument("--csv", type=Path, help="default: --output-json with .csv")
    out.add_argument("--plot", type=Path, help="default: --output-json with .png")
    out.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    # -- step probe (issue 15): its own options, in client/tools/benchmarks/step_probe.py --
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--step-probe" in argv:
        from client.tools.benchmarks.step_probe import main as step_probe_main
        return step_probe_main([a for a in argv if a != "--step-probe"])
    if "--goodput" in argv:  # the highest Poisson rate meeting an SLO (client/tools/benchmarks/goodput.py)
        from client.tools.benchmarks.goodput import main as goodput_main
        return goodput_main([a for a in argv if a != "--goodput"])
    # -- end step probe --
    args = build_parser().parse_args(argv)
    if args.num_requests < 1:
        print("inflight bench: --num-requests must be >= 1", file=sys.stderr)
        return 2
    if (args.in_process or args.compare_server or args.offline) and not args.model_path:
        print("inflight bench: --in-process, --offline and --compare-server need --model-path DIR", file=sys.stderr)
        return 2
    if args.speculative_config and not args.in_process:
        print("inflight bench: --speculative-config needs --in-process", file=sys.stderr)
        return 2
    if args.model_path and not Path(args.model_path).is_dir():
        print(f"inflight bench: --model-path {args.model_path} is not a folder", file=sys.stderr)
        return 2
    if args.workload in ("images", "embeddings"):  # (client/tools/benchmarks/mm_requests.py)
        if args.offline or (not args.in_process and (args.compare_server or args.protocol != "openai")):
            print(f"inflight bench: --workload {args.workload} runs --in-process or through an OpenAI port "
                  "(--protocol openai --url HOST:PORT)", file=sys.stderr)
            return 2
        if args.workload == "images" and not args.in_process and args.prompt_format == "ids":
            args.prompt_format = "text"  # chat messages: text beside the image parts
    params = dict(args.param)
    progress = not args.no_progress and sys.stderr.isatty()
    tokenizer = None
    vocab = DEFAULT_VOCAB_SIZE
    if args.model_path:
        from backend.models.loader import load_model_config
        vocab = load_model_config(args.model_path).vocab_size
        if args.prompt_format == "text" or args.workload == "extractive":
            from backend.text.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_dir(args.model_path)
    try:
        items = make_workload(args.workload, args.num_requests, seed=args.seed, rate=args.rate,
                              prompt_format=args.prompt_format, vocab_size=vocab, tokenizer=tokenizer,
                              fixed_prompt_len=args.fixed_prompt_len, fixed_output_len=args.fixed_output_len,
                              max_output_len=args.max_output_len)
    except ValueError as exc:
        print(f"inflight bench: {exc}", file=sys.stderr)
        return 2
    # Warm-up on the workload's longest prompts: the first long attention shapes and allocations
    # are paid before the clock starts, by every target alike.
    longest = sorted(items, key=lambda w: -w.prompt_len)[:max(args.warmup, 0)]
    warm = [dataclasses.replace(w, index=i, max_tokens=min(4, w.max_tokens), arrival_s=0.0, ignore_eos=True)
            for i, w in enumerate(longest)]

    results: list[dict] = []
    started = _dt.datetime.now().astimezone()
    server = None

    def measure(target, concurrencies) -> None:
        if warm and not getattr(target, "warmed", False):  # untimed: first-call costs out of the way
            target.run(warm, len(warm))
            target.warmed = True
        for c in ([len(items)] if isinstance(target, OfflineTarget) else concurrencies):
            r = target.run(items, c, progress)
            row = {"target": target.name, "mode": target.mode, "concurrency": c, "rate": args.rate,
                   "repeat": sum(x["target"] == target.name and x["mode"] == target.mode
                                 and x["concurrency"] == c for x in results), **r}
            results.append(row)
            print(f"  {target.name:<12} {target.mode:<8} c={c:<4} {_fmt(r['output_tokens_per_s'])} out tok/s, "
                  f"{_fmt(r['requests_per_s'])} req/s, p99 e2e {_fmt(r['e2e_p99_s'], 'ms')} ms, "
                  f"failed {r['failed']}", file=sys.stderr, flush=True)

    try:
        if args.compare_server:
            if args.url:
                url, metrics_url, pid = args.url, args.metrics_url, None
            else:
                print("inflight bench: starting a local tritonserver ...", file=sys.stderr, flush=True)
                server = start_local_server(args.model_path, {**params, "batching_mode": "inflight"})
                url = server.grpc_url if args.protocol == "grpc" else server.http_url
                metrics_url, pid = server.metrics_url, server.process.pid
            streams = [True, False] if args.also_no_stream else [not args.no_stream]
            servers = [ServerTarget(url, args.protocol, metrics_url, vocab, pid, stream=s) for s in streams]
            local = InProcessTarget(args.model_path, "inflight", params)
            try:
                targets = [local, *servers]
                for c in args.concurrency:  # interleaved (A B C C B A), so that load drift hits all alike
                    for i in range(args.repeats):
                        for t in (targets if i % 2 == 0 else targets[::-1]):
                            measure(t, [c])
            finally:
                local.close()
        elif args.speculative_config:  # speculative decoding against none, in-process
            from client.tools.benchmarks.spec import compare
            compare(args.model_path, params, args.speculative_config, args.concurrency, args.repeats, measure)
        elif args.in_process or args.offline:
            kind = OfflineTarget if args.offline else InProcessTarget
            # Modes take turns at each concurrency, in alternating order per repeat (A B C,
            # C B A, ...), so that a slow spell on a shared machine hits them alike. Each turn
            # builds its engine (before the clock starts) and closes it after: idle engines on
            # other threads keep their own OpenMP pools, and three idle ones made the running
            # engine about 2x slower on 2 cores.
            for c in ([len(items)] if args.offline else args.concurrency):
                for i in range(args.repeats):
                    for mode in (args.mode if i % 2 == 0 else args.mode[::-1]):
                        target = kind(args.model_path, mode, params)
                        try:
                            measure(target, [c])
                        finally:
                            target.close()
        else:
            target = ServerTarget(args.url or "localhost:8001", args.protocol, args.metrics_url, vocab,
                                  stream=not args.no_stream)
            if args.mode != ["inflight"] and target.mode not in args.mode:
                print(f"inflight bench: the server runs batching_mode={target.mode}; --mode is for "
                      f"--in-process (reporting the server's mode)", file=sys.stderr)
            for _ in range(args.repeats):
                measure(target, args.concurrency)
    except KeyboardInterrupt:
        print("inflight bench: interrupted", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()

    print()
    print_table(results)
    rs = ratios(results)
    if args.speculative_config:
        from client.tools.benchmarks.spec import print_acceptance, spec_ratios
        print_acceptance(results)
        rs += spec_ratios(results)
    if rs:
        print()
        for r in rs:
            extra = ""
            if "in_process_output_tokens_per_s" in r:
                extra = (f"  (server {r['server_output_tokens_per_s']:.0f} vs in-process "
                         f"{r['in_process_output_tokens_per_s']:.0f} out tok/s)")
            if r["per_repeat"]:
                extra += "  repeat by repeat: " + ", ".join(f"{x:.2f}x" for x in r["per_repeat"])
            print(f"c={r['concurrency']:<4} {r['kind']:<28} {r['ratio']:.2f}x{extra}")
    meta = {"date": started.isoformat(timespec="seconds"), "machine": machine(),
            "command": "inflight bench " + " ".join(sys.argv[1:] if argv is None else argv),
            "workload": args.workload, "seed": args.seed, "rate": args.rate,
            "workload_summary": summary(items), "params": params,
            **({"speculative_config": args.speculative_config} if args.speculative_config else {})}
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({"meta": meta, "results": results, "ratios": rs}, indent=2))
        csv_path = args.csv or args.output_json.with_suffix(".csv")
        plot_path = args.plot or args.output_json.with_suffix(".png")
    else:
        csv_path, plot_path = args.csv, args.plot
    if csv_path:
        write_csv(results, csv_path)
    if plot_path and results:
        plot(results, plot_path, f"{args.workload} workload, {len(items)} requests - {meta['machine']} - "
                                 f"{meta['date']}")
    failed = sum(r["failed"] for r in results)
    if failed:
        errors = sorted({e for r in results for e in r.get("errors", [])})
        print(f"inflight bench: {failed} request(s) failed: {'; '.join(errors[:5])}", file=sys.stderr)
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
