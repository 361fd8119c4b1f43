"""python -m client.tools.peers: run the peer comparison (see __init__) and print tok/s, peak RSS and
ratios, below the machine they ran on (machine.py: the CPU, its ISA flags, the kernels' builds).
`python -m client.tools.peers table ...` runs issue 47's table instead (table.py: models by columns).
Engines run one after another on the same workload; with --repeats R they run R times in
alternating order (A B C, C B A, ...), and the ratios are taken within each round, so a machine
whose load drifts skews every engine of a round alike."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from client.tools.peers.common import die_with_parent
from client.tools.peers.machine import describe, machine_report
from client.tools.benchmarks.workloads import make_workload

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# engine -> (venv under --peers-dir, or None for this interpreter; the runner; which model it reads:
# "model" the --model-path folder, "float" --float-model-path (float weights), "gguf" --gguf)
ENGINES = {"inflight": (None, "client.tools.peers.run_inflight", "model"),
           # the same engine with its decode steps through the Python layers (backend/worker/native_decode.py)
           "inflight-python-layers": (None, "client.tools.peers.run_inflight", "model"),
           # the same engine as on an AVX2-only CPU, forced on an AVX-512 one (AVX2_ONLY)
           "inflight-avx2": (None, "client.tools.peers.run_inflight", "model"),
           "inflight-float32": (None, "client.tools.peers.run_inflight", "float"),
           "inflight-bf16": (None, "client.tools.peers.run_inflight", "float"),
           "llamacpp": (None, "client.tools.peers.run_llamacpp", "gguf"),
           # llama.cpp built for AVX2 alone (`make peers-llamacpp-avx2`): inflight-avx2's peer, as an
           # AVX2-only CPU would have both
           "llamacpp-avx2": (None, "client.tools.peers.run_llamacpp", "gguf"),
           "vllm": ("vllm", HERE / "run_vllm.py", "float"),
           "transformers": ("transformers", HERE / "run_transformers.py", "float")}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.tools.peers", description=__doc__)
    p.add_argument("--peers-dir", type=Path, default=Path.home() / ".cache" / "inflight-peers")
    p.add_argument("--model-path", action="append", required=True, help="repeat for several models")
    p.add_argument("--float-model-path", help="the same model with float weights, for the engines that "
                   "cannot read packed ones (vllm, transformers, inflight-float32, inflight-bf16); "
                   "default: --model-path")
    p.add_argument("--gguf", type=Path, help="the GGUF file --model-path was imported from (llamacpp)")
    p.add_argument("--llama-server", type=Path, help="default: PEERS_DIR/llama.cpp-build/bin/llama-server")
    p.add_argument("--llama-server-avx2", type=Path,
                   help="llamacpp-avx2's; default: PEERS_DIR/llama.cpp-build-avx2/bin/llama-server")
    p.add_argument("--num-requests", type=_ints, default=[32, 128], help="comma list: one run per count")
    p.add_argument("--concurrency", type=int, default=0,
                   help="requests in flight at once: 0 all at once (default), 1 one at a time in turn "
                        "(max_num_seqs 1, one llama.cpp slot)")
    p.add_argument("--engines", default="inflight,vllm,transformers")
    p.add_argument("--repeats", type=int, default=1, help="rounds, in alternating engine order")
    p.add_argument("--workload", default="mixed")
    p.add_argument("--prompt-lens", type=_ints, default=[],
                   help="prompt processing: one run per length (comma list), every prompt that many tokens "
                        "and --output-len output tokens (the `fixed` workload); ratios of prompt tok/s")
    p.add_argument("--output-len", type=int, default=1, help="with --prompt-lens: output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inflight-threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="OMP_NUM_THREADS for inflight's runner and llama.cpp's -t (default: one per core, "
                        "pinned, as vLLM-CPU binds one OpenMP thread per core; the other peers keep theirs)")
    p.add_argument("--output-json", type=Path)
    return p


def _command(engine: str, args) -> list[str]:
    venv, runner, _ = ENGINES[engine]
    if venv is None:
        return [sys.executable, "-m", str(runner)]
    python = args.peers_dir / venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"bench-peers: {python} is missing; build the peer venvs first (make bench-peers does)")
    return [str(python), str(runner)]


# What an AVX2-only CPU gives inflight, forced on a bigger one: our packed and float GEMMs' AVX2
# builds (INFLIGHT_CPU_ISA caps both), oneDNN's GEMMs (float and bfloat16 layers, with AMX or
# AVX-512 otherwise) and torch's own vectorized ops capped at AVX2 too.
AVX2_ONLY = {"INFLIGHT_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


# llama.cpp's builds: engine -> (its folder under --peers-dir, the make target that builds it)
LLAMACPP_BUILDS = {"llamacpp": ("llama.cpp-build", "peers-llamacpp"),
                   "llamacpp-avx2": ("llama.cpp-build-avx2", "peers-llamacpp-avx2")}


def llama_server(engine: str, args) -> Path:
    """The llama-server binary of a llama.cpp engine: --llama-server (--llama-server-avx2) or its build's."""
    given = getattr(args, "llama_server_avx2" if engine == "llamacpp-avx2" else "llama_server", None)
    return Path(given) if given else args.peers_dir / LLAMACPP_BUILDS[engine][0] / "bin" / "llama-server"


def run_engine(engine: str, args, model_path: str, workload: Path, tmp: Path) -> dict:
    out = tmp / f"{engine}.json"
    role = ENGINES[engine][2]
    path = {"model": model_path, "float": args.float_model_path or model_path, "gguf": args.gguf}[role]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               TOKENIZERS_PARALLELISM="false")
    if engine.startswith("inflight") and args.inflight_threads:
        env["OMP_NUM_THREADS"] = str(args.inflight_threads)
    if engine == "inflight-avx2":
        env.update(AVX2_ONLY)
    if engine == "inflight-python-layers":
        env["INFLIGHT_NATIVE_DECODE"] = "0"
    if engine in LLAMACPP_BUILDS:
        server = llama_server(engine, args)
        if not args.gguf or not Path(server).exists():
            return {"engine": engine, "error": f"needs --gguf and {server} (make {LLAMACPP_BUILDS[engine][1]} "
                                               "builds it)"}
        env.update(LLAMACPP_GGUF=str(Path(args.gguf).resolve()), LLAMACPP_SERVER=str(server),
                   LLAMACPP_THREADS=str(args.inflight_threads or ""))
    cmd = _command(engine, args) + ["--model-path", str(Path(path).resolve()), "--workload", str(workload),
                                    "--out", str(out), "--concurrency", str(args.concurrency)]
    if engine == "inflight-float32":
        cmd += ["--dtype", "float32"]
    elif engine == "inflight-bf16":
        cmd += ["--dtype", "bfloat16"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          preexec_fn=die_with_parent)  # a stopped table stops its runner (and its server)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        return {"engine": engine, "error": f"exit {proc.returncode}:\n{tail}"}
    return {**json.loads(out.read_text()), "engine": engine, "name": json.loads(out.read_text())["engine"]}


def _summary(rounds: list[dict[str, dict]], engines: list[str], key: str = "output_tok_s") -> list[dict]:
    """Per engine: median tok/s (output and prompt), peak RSS, and the first engine's ``key`` tok/s
    over its own within each round (the ratios the targets are stated in)."""
    base, rows = engines[0], []
    for e in engines:
        ok = [r[e] for r in rounds if "error" not in r[e]]
        if not ok:
            rows.append({"engine": e, "error": rounds[-1][e]["error"]})
            continue
        ratios = [r[base][key] / r[e][key] for r in rounds if "error" not in r[base] and "error" not in r[e]]
        rows.append({"engine": e, "name": ok[0].get("name", e),
                     "output_tok_s": statistics.median(x["output_tok_s"] for x in ok),
                     "prompt_tok_s": statistics.median(x["prompt_tok_s"] for x in ok),
                     "peak_rss_mb": max(x.get("peak_rss_mb") or 0 for x in ok),
                     "ratio_of_first": ratios, "runs": ok})
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["table"]:  # issue 47's table of models and columns (table.py)
        from client.tools.peers.table import main as table_main
        return table_main(argv[1:])
    args = build_parser().parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        print(f"bench-peers: unknown --engines {unknown}; known: {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    from backend.models.loader import load_model_config
    machine = machine_report(llama_server("llamacpp", args))
    print(describe(machine))
    report = []
    key = "prompt_tok_s" if args.prompt_lens else "output_tok_s"
    for model_path in args.model_path:
        vocab = load_model_config(model_path).vocab_size
        for prompt_len, n in itertools.product(args.prompt_lens or [None], args.num_requests):
            items = (make_workload("fixed", n, seed=args.seed, vocab_size=vocab, fixed_prompt_len=prompt_len,
                                   fixed_output_len=args.output_len) if prompt_len else
                     make_workload(args.workload, n, seed=args.seed, vocab_size=vocab))
            rounds = []
            with tempfile.TemporaryDirectory(prefix="inflight-peers-") as tmp:
                workload = Path(tmp) / "workload.json"
                workload.write_text(json.dumps([{"input_ids": w.prompt, "max_tokens": w.max_tokens} for w in items]))
                for rnd in range(args.repeats):
                    order = engines if rnd % 2 == 0 else engines[::-1]
                    rounds.append({e: run_engine(e, args, model_path, workload, Path(tmp)) for e in order})
            rows = _summary(rounds, engines, key)
            report.append({"model_path": model_path, "num_requests": n, "concurrency": args.concurrency,
                           "prompt_len": prompt_len, "machine": machine, "results": rows})
            print(f"\n{model_path}, {n} {'fixed' if prompt_len else args.workload} requests, concurrency "
                  f"{args.concurrency or 'all'} ({sum(len(w.prompt) for w in items)} prompt, "
                  f"{sum(w.max_tokens for w in items)} output tokens)")
            for r in rows:
                if "error" in r:
                    print(f"  {r['engine']:<18} failed: {r['error']}")
                    continue
                ratio = ", ".join(f"{x:.2f}x" for x in r["ratio_of_first"])
                own = [x["server_prompt_tok_s"] for x in r["runs"] if "server_prompt_tok_s" in x]
                print(f"  {r['name']:<40} {r['output_tok_s']:>8.1f} output tok/s {r['prompt_tok_s']:>8.1f} prompt "
                      f"tok/s  peak RSS {r['peak_rss_mb']:>7.0f} MB  {engines[0]} / it ({key}): {ratio}"
                      + (f"  (its own prompt tok/s: {', '.join(f'{x:.1f}' for x in own)})" if own else ""))
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2))
    failed = any("error" in r for case in report for r in case["results"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
