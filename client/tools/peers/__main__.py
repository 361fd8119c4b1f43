"""python -m client.tools.peers: run the peer comparison (see __init__) and print tok/s and ratios."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from client.tools.workloads import make_workload

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
# engine -> (venv under --peers-dir, or None for this interpreter; the runner)
ENGINES = {"inflight": (None, "client.tools.peers.run_inflight"),
           "vllm": ("vllm", HERE / "run_vllm.py"),
           "transformers": ("transformers", HERE / "run_transformers.py")}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.tools.peers", description=__doc__)
    p.add_argument("--peers-dir", type=Path, default=Path.home() / ".cache" / "inflight-peers")
    p.add_argument("--model-path", action="append", required=True, help="repeat for several models")
    p.add_argument("--num-requests", type=_ints, default=[32, 128], help="comma list: one run per count")
    p.add_argument("--engines", default="inflight,vllm,transformers")
    p.add_argument("--workload", default="mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inflight-threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="OMP_NUM_THREADS for inflight's runner (default: one per core, pinned, as vLLM-CPU "
                        "binds one OpenMP thread per core; the peers keep their own defaults)")
    p.add_argument("--output-json", type=Path)
    return p


def _command(engine: str, peers_dir: Path) -> list[str]:
    venv, runner = ENGINES[engine]
    if venv is None:
        return [sys.executable, "-m", str(runner)]
    python = peers_dir / venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"bench-peers: {python} is missing; build the peer venvs first (make bench-peers does)")
    return [str(python), str(runner)]


def run_engine(engine: str, peers_dir: Path, model_path: str, workload: Path, tmp: Path,
               inflight_threads=None) -> dict:
    out = tmp / f"{engine}.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               TOKENIZERS_PARALLELISM="false")
    if engine == "inflight" and inflight_threads:
        env["OMP_NUM_THREADS"] = str(inflight_threads)
    cmd = _command(engine, peers_dir) + ["--model-path", str(Path(model_path).resolve()),
                                          "--workload", str(workload), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        return {"engine": engine, "error": f"exit {proc.returncode}:\n{tail}"}
    return json.loads(out.read_text())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        print(f"bench-peers: unknown --engines {unknown}; known: {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    from backend.loader import load_model_config
    report = []
    for model_path in args.model_path:
        vocab = load_model_config(model_path).vocab_size
        for n in args.num_requests:
            items = make_workload(args.workload, n, seed=args.seed, vocab_size=vocab)
            with tempfile.TemporaryDirectory(prefix="inflight-peers-") as tmp:
                workload = Path(tmp) / "workload.json"
                workload.write_text(json.dumps([{"input_ids": w.prompt, "max_tokens": w.max_tokens} for w in items]))
                rows = [run_engine(e, args.peers_dir, model_path, workload, Path(tmp), args.inflight_threads)
                        for e in engines]
            case = {"model_path": model_path, "num_requests": n, "results": rows}
            base = next((r for r in rows if r["engine"] == "inflight" and "error" not in r), None)
            print(f"\n{model_path}, {n} {args.workload} requests "
                  f"({sum(len(w.prompt) for w in items)} prompt, {sum(w.max_tokens for w in items)} output tokens)")
            for r in rows:
                if "error" in r:
                    print(f"  {r['engine']:<16} failed: {r['error']}")
                    continue
                ratio = f"inflight = {base['output_tok_s'] / r['output_tok_s']:.2f}x" if base else ""
                print(f"  {r['engine']:<16} {r['output_tok_s']:>9.1f} output tok/s  {r['elapsed_s']:>7.1f} s  {ratio}")
            report.append(case)
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2))
    failed = any("error" in r for case in report for r in case["results"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
