"""`python -m client.tools.peers table` (`make bench-peers-table`): issue 47's table, inflight against
llama.cpp's `llama-server` on the same GGUF file with the same threads, one interleaved run per row.

Rows (table_rows.py): SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M, a Qwen3-0.6B-shaped Q8_0 and Q4_K file,
a Qwen3-MoE-shaped file, SmolLM2 as F16 and BF16. Columns, each its own workload of random token ids
(seeded), greedy with ignore_eos, every engine in alternating order per round (--repeats):

- ``single``: --single-requests requests of the mixed workload one at a time (output tok/s);
- ``batch32``: --batch-requests of them all at once (output tok/s);
- ``prompt_short`` / ``prompt_long``: --prompt-requests prompts of exactly --prompt-lens tokens, one
  at a time, one output token: time to first token (each engine's own: inflight's from the request's
  add to its first token in process, llama-server's ``prompt_ms``), prompt tok/s over wall time beside;
- ``decode_ctx``: one prompt of --decode-context minus --decode-tokens tokens, then --decode-tokens
  tokens decoded at that context: the decode rate after the first token (both engines count it alike).

Ratios are inflight's figure over llama.cpp's (llama.cpp's TTFT over inflight's) within each round.
inflight runs as built for the CPU (``inflight``) and, on a CPU that lists AVX-512, again with its
AVX2 build forced (``inflight-avx2``: INFLIGHT_CPU_ISA=avx2, and since 2026-12-04 oneDNN and torch's
ops capped at AVX2 too, __main__.AVX2_ONLY: before, its float rows kept oneDNN's AVX-512/AMX GEMMs
and overstated an AVX2-only CPU; since the evening of 2026-12-04 INFLIGHT_CPU_ISA caps inflight's
-march=native kernels as well, attention and norms, which had kept AVX-512), as the issue-37 runs did; llama.cpp is
`make peers-llamacpp`'s build for this CPU. The issue asks each inflight build against llama.cpp
"built for that ISA": where `make peers-llamacpp-avx2` has built llama.cpp for AVX2 alone, it runs
too (``llamacpp-avx2``) and is inflight-avx2's peer, as both would be on an AVX2-only CPU; the ratio
of inflight-avx2 over llama.cpp's build for this CPU (the harder one, the earlier runs' only one)
stays in the JSON as ``cross_ratios``. Without that build inflight-avx2 is compared with the native
llama.cpp, and the run says so. The JSON holds the machine (CPU model, ISA flags, builds),
the command, times and load averages of every cell; table_plot.py draws the PNG next to it.
Sizes are flags, so a smoke run (`--smoke`) takes minutes: the figures of such a run are no claim.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

from client.tools.peers import table_rows
from client.tools.peers.table_rows import COLUMNS, ROWS

REPO = Path(__file__).resolve().parents[3]
SMOKE = ["--single-requests", "2", "--batch-requests", "4", "--prompt-requests", "1", "--prompt-lens", "64,128",
         "--decode-context", "256", "--decode-tokens", "8"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.tools.peers table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--columns", default=",".join(COLUMNS), help=f"comma list of {', '.join(COLUMNS)}")
    p.add_argument("--all-cells", action="store_true", help="also the cells the issue sets no target for (—)")
    p.add_argument("--builds", choices=("auto", "native", "both"), default="auto",
                   help="inflight's builds: auto = both where the CPU lists avx512f, else its own")
    p.add_argument("--single-requests", type=int, default=8)
    p.add_argument("--batch-requests", type=int, default=32)
    p.add_argument("--prompt-lens", default="512,4096", help="the short and the long prompt, tokens")
    p.add_argument("--prompt-requests", type=int, default=4)
    p.add_argument("--decode-context", type=int, default=8192)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="rounds per cell, engines in alternating order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"the smallest sizes: {' '.join(SMOKE)} (later flags win)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="inflight's OMP_NUM_THREADS and llama-server's -t/-tb")
    p.add_argument("--kv-gib", type=float, default=4.0, help="inflight's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--work-dir", type=Path, default=REPO / "models" / ".cache" / "peers-table",
                   help="the rows' GGUF files and their imports, made once")
    p.add_argument("--cache-dir", type=Path, default=REPO / "models" / ".cache", help="the model wheels' cache")
    p.add_argument("--peers-dir", type=Path, default=Path.home() / ".cache" / "inflight-peers")
    p.add_argument("--llama-server", type=Path, help="default: PEERS_DIR/llama.cpp-build/bin/llama-server")
    p.add_argument("--llama-server-avx2", type=Path, help="llama.cpp built for AVX2 alone, inflight-avx2's peer; "
                   "default: PEERS_DIR/llama.cpp-build-avx2/bin/llama-server (make peers-llamacpp-avx2)")
    p.add_argument("--output-json", type=Path, default=REPO / "docs" / "bench" / "peers_table.json",
                   help="the PNG goes next to it (same name, .png)")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    args = build_parser().parse_args(SMOKE + argv if "--smoke" in argv else argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    for what, names, known in (("--rows", args.rows, ROWS), ("--columns", args.columns, COLUMNS)):
        if unknown := [n for n in names if n not in known]:
            raise SystemExit(f"peers table: unknown {what} {unknown}; known: {', '.join(known)}")
    if len(args.prompt_lens) != 2 or min(args.prompt_lens) < 1:
        raise SystemExit(f"peers table: --prompt-lens takes two lengths (short,long); got {args.prompt_lens}")
    if not 0 < args.decode_tokens < args.decode_context:
        raise SystemExit(f"peers table: --decode-tokens {args.decode_tokens} must be in 1..--decode-context - 1")
    from client.tools.peers.__main__ import llama_server
    args.llama_server, args.llama_server_avx2 = llama_server("llamacpp", args), llama_server("llamacpp-avx2", args)
    return args


def engines_for(machine: dict, builds: str, avx2_peer: bool = False) -> list[str]:
    """The engines of every cell: inflight as built for this CPU and llama.cpp's build for it; with both
    builds, inflight-avx2 too, and llama.cpp's AVX2 build where there is one (`avx2_peer`)."""
    both = builds == "both" or (builds == "auto" and machine["isa_flags"].get("avx512f"))
    if not both:
        return ["inflight", "llamacpp"]
    return ["inflight", "inflight-avx2", "llamacpp"] + (["llamacpp-avx2"] if avx2_peer else [])


def peers_of(engines: list[str]) -> dict[str, str]:
    """Each inflight engine's llama.cpp: the build for the same ISA where it runs, else the native one."""
    return {e: "llamacpp-avx2" if e == "inflight-avx2" and "llamacpp-avx2" in engines else "llamacpp"
            for e in engines if not e.startswith("llamacpp")}


def cell_workload(column: str, args, vocab: int) -> tuple[list, int, str]:
    """(work items, concurrency, the figure compared) of one column."""
    from client.tools.benchmarks.workloads import make_workload
    fixed = lambda n, prompt, out: make_workload("fixed", n, seed=args.seed, vocab_size=vocab,  # noqa: E731
                                                 fixed_prompt_len=prompt, fixed_output_len=out)
    if column == "single":
        return make_workload("mixed", args.single_requests, seed=args.seed, vocab_size=vocab), 1, "output_tok_s"
    if column == "batch32":
        return make_workload("mixed", args.batch_requests, seed=args.seed, vocab_size=vocab), 0, "output_tok_s"
    if column in ("prompt_short", "prompt_long"):
        return fixed(args.prompt_requests, args.prompt_lens[column == "prompt_long"], 1), 1, "ttft_s"
    return fixed(1, args.decode_context - args.decode_tokens, args.decode_tokens), 1, "decode_tok_s"


def ratios(rounds: list[dict], pairs: dict[str, str], key: str) -> dict[str, list[float]]:
    """Per inflight engine, its ``key`` over its peer's (``pairs``: engine -> llama.cpp build) in each
    round both finished (for ttft_s, the peer's over its: the higher the better either way)."""
    out = {}
    for e, peer in pairs.items():
        values = []
        for r in rounds:
            a, b = r[e].get(key), r[peer].get(key)
            if "error" not in r[e] and "error" not in r[peer] and a and b:
                values.append(b / a if key == "ttft_s" else a / b)
        out[e] = values
    return out


def run_cell(row: str, column: str, args, model_dir: Path, gguf: Path, engines: list[str], vocab: int) -> dict:
    from client.tools.peers.__main__ import run_engine
    items, concurrency, key = cell_workload(column, args, vocab)
    ns = SimpleNamespace(gguf=gguf, llama_server=args.llama_server, llama_server_avx2=args.llama_server_avx2,
                         peers_dir=args.peers_dir,
                         inflight_threads=args.threads, concurrency=concurrency, float_model_path=None)
    started, load0 = _now(), os.getloadavg()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="inflight-peers-table-") as tmp:
        workload = Path(tmp) / "workload.json"
        workload.write_text(json.dumps([{"input_ids": w.prompt, "max_tokens": w.max_tokens} for w in items]))
        for rnd in range(args.repeats):
            order = engines if rnd % 2 == 0 else engines[::-1]
            rounds.append({e: run_engine(e, ns, str(model_dir), workload, Path(tmp)) for e in order})
    cell = {"row": row, "column": column, "figure": key, "target": table_rows.target(row, column),
            "requests": len(items), "concurrency": concurrency,
            "prompt_tokens": sum(len(w.prompt) for w in items), "output_tokens": sum(w.max_tokens for w in items),
            "started": started, "finished": _now(), "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()),
            "rounds": rounds, "ratios": ratios(rounds, peers_of(engines), key)}
    if "llamacpp-avx2" in engines:  # inflight-avx2 against llama.cpp's build for this CPU, as before
        cell["cross_ratios"] = ratios(rounds, {"inflight-avx2": "llamacpp"}, key)
    cell["median"] = {e: statistics.median(v) if v else None for e, v in cell["ratios"].items()}
    return cell


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _print_cell(cell: dict, engines: list[str]) -> None:
    pairs = peers_of(engines)
    figs = []
    for e in engines:
        values = [r[e].get(cell["figure"]) for r in cell["rounds"] if "error" not in r[e]]
        errors = [r[e]["error"].splitlines()[-1][:160] for r in cell["rounds"] if "error" in r[e]]
        figs.append(f"{e} {', '.join(f'{v:.4g}' for v in values if v is not None)}" + (f" FAILED: {errors[0]}" if errors else ""))
    shown = [(f"{e}/{pairs[e]}", v) for e, v in cell["ratios"].items()] + \
        [(f"{e}/llamacpp", v) for e, v in cell.get("cross_ratios", {}).items()]
    ratio = "; ".join(f"{name} {', '.join(f'{x:.2f}x' for x in v) or '-'}" for name, v in shown)
    target = f"target >= {cell['target']}x" if cell["target"] else "no target"
    print(f"  {cell['column']:<13} {cell['figure']:<13} {' | '.join(figs)}  ->  {ratio}  ({target}; load "
          f"{cell['loadavg_before'][0]:.2f} -> {cell['loadavg_after'][0]:.2f})", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from backend.models.loader import load_model_config
    from client.tools.peers.machine import build_text, describe, llamacpp_build_options, machine_report
    from client.tools.peers.table_plot import plot
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    machine = dict(machine_report(args.llama_server))
    engines = engines_for(machine, args.builds, avx2_peer=args.llama_server_avx2.exists())
    print(describe(machine), flush=True)
    if "llamacpp-avx2" in engines:
        machine["llamacpp_avx2_build"] = llamacpp_build_options(args.llama_server_avx2)
        print(f"inflight-avx2's peer: llama.cpp built with {build_text(machine['llamacpp_avx2_build'])}", flush=True)
    elif "inflight-avx2" in engines:
        print(f"inflight-avx2's peer: llama.cpp's build for this CPU ({args.llama_server_avx2} not found: "
              "make peers-llamacpp-avx2 builds llama.cpp for AVX2 alone)", flush=True)
    report = {"command": "python -m client.tools.peers table " + " ".join(sys.argv[1:] if argv is None else argv),
              "started": _now(), "machine": machine, "engines": engines, "peers": peers_of(engines),
              "threads": args.threads,
              "sizes": {k: getattr(args, k) for k in ("single_requests", "batch_requests", "prompt_lens", "prompt_requests",
                                                      "decode_context", "decode_tokens", "repeats", "seed", "kv_gib")},
              "smoke": args.smoke, "rows": []}
    files = table_rows.row_files(args.rows, args.work_dir, args.cache_dir)
    failed = False
    for row in args.rows:
        model_dir = table_rows.imported(files[row], args.work_dir)
        vocab = load_model_config(model_dir).vocab_size
        print(f"\n{ROWS[row].label} ({files[row].name}), {args.threads} threads", flush=True)
        entry = {"row": row, "label": ROWS[row].label, "gguf": str(files[row]), "model_path": str(model_dir), "cells": []}
        for column in args.columns:
            if table_rows.target(row, column) is None and not args.all_cells:
                continue
            cell = run_cell(row, column, args, model_dir, files[row], engines, vocab)
            failed |= any("error" in r[e] for r in cell["rounds"] for e in engines)
            entry["cells"].append(cell)
            _print_cell(cell, engines)
        report["rows"].append(entry)
        _save(report, args.output_json)  # a long run keeps what it has
    report["finished"] = _now()
    _save(report, args.output_json)
    png = plot(report, args.output_json.with_suffix(".png"))
    print(f"\npeers table: {args.output_json} and {png}")
    return 1 if failed else 0


def _save(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
