"""`inflight gpu-check`: the GPU acceptance script. On a CUDA machine, in a few minutes:

    inflight gpu-check --out gpu-check/        (or: make gpu-check)

1. kernels: every Triton kernel against its torch reference in bf16, fp16 and fp32; paged decode
   attention's bandwidth against a measured device copy bandwidth; the decode step of a
   Llama-3-8B-shaped random bf16 model at batch 1/16/64 against its bandwidth floor
   (kernels/bench.py, run as `python -m kernels.bench`);
2. greedy: the engine's greedy tokens (Triton kernels, bf16) against transformers on the same GPU
   and checkpoint, teacher-forced: at every position the engine's token must be transformers'
   argmax or within a near-tie of it (bf16 rounding may flip a tie; after that the texts differ
   legitimately, and teacher forcing keeps checking on the engine's own path);
3. served: in-flight throughput through a local tritonserver against in-process, in one run
   (`python -m client.tools.bench --compare-server`).

It writes DIR/gpu_check.json and DIR/gpu_check.md (a table to paste into docs/performance.md) and
exits 1 if a correctness check failed. `--dry-run` rehearses all of it on the CPU with tiny shapes
(kernels under TRITON_INTERPRET=1; its timings mean nothing): the test suite runs it, so on the
first GPU at hand only the real run is left.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
# Per mode: kernels.bench arguments, the greedy model (make_model overrides) and its run, and the
# served-vs-in-process benchmark arguments.
FULL = dict(bench=["--batches", "1,16,64", "--contexts", "1024,4096", "--engine-contexts", "1024",
                   "--iters", "20"],
            model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=4),
            dtype="bfloat16", prompts=8, max_tokens=64, near_tie=0.125,
            served=["--num-requests", "256", "--concurrency", "64"])
DRY = dict(bench=["--dry-run-cpu", "--batches", "1,2", "--contexts", "40", "--engine-contexts", "20",
                  "--skip-reference"],
           model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
           dtype="float32", prompts=3, max_tokens=8, near_tie=1e-3,
           served=["--num-requests", "6", "--concurrency", "3", "--max-output-len", "8", "--warmup", "0"])


def run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    sys.stdout.write(proc.stdout[-6000:])
    if proc.returncode:
        sys.stderr.write(proc.stderr[-6000:])
    return proc


def check_kernels(p: dict, out: Path, env: dict) -> dict:
    path = out / "kernel_bench.json"
    proc = run([sys.executable, "-m", "kernels.bench", "--out", str(path), *p["bench"]], env, 1800)
    if not path.exists():
        return {"ok": False, "error": f"kernels.bench exited {proc.returncode}: {proc.stderr[-500:]}"}
    res = json.loads(path.read_text())
    return {"ok": proc.returncode == 0 and res["failed_checks"] == 0, **res}


def check_greedy(p: dict, model_dir: Path, device: str) -> dict:
    """The engine's greedy tokens against transformers' logits, teacher-forced on the engine's path."""
    import torch
    from transformers import AutoModelForCausalLM

    from backend import LLM, SamplingParams

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 40, (p["prompts"],), generator=gen)]
    llm = LLM(str(model_dir), dtype=p["dtype"], device=device, attention_backend="triton", max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(max_tokens=p["max_tokens"], temperature=0.0, ignore_eos=True))
    del llm
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    rows = []
    for prompt, o in zip(prompts, outs):
        ids = torch.tensor([prompt + list(o.token_ids)], device=device)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1:-1].float()          # predicts each output token
        ours = torch.tensor(o.token_ids, device=device)
        gap = logits.max(-1).values - logits.gather(1, ours[:, None])[:, 0]   # 0 where ours is the argmax
        exact = int((gap == 0).cumprod(0).sum())
        rows.append(dict(prompt_len=len(prompt), tokens=len(o.token_ids), same_until=exact,
                         max_gap=float(gap.max()), ok=bool(gap.max() <= p["near_tie"])))
    return {"ok": all(r["ok"] for r in rows), "near_tie": p["near_tie"], "dtype": p["dtype"], "rows": rows}


def check_served(p: dict, model_dir: Path, out: Path, env: dict) -> dict:
    path = out / "served_vs_in_process.json"
    proc = run([sys.executable, "-m", "client.tools.bench", "--compare-server", "--model-path", str(model_dir),
                "--output-json", str(path), "--no-progress", *p["served"]], env, 1800)
    if not path.exists():
        return {"ok": False, "error": f"bench exited {proc.returncode}: {proc.stderr[-500:]}"}
    res = json.loads(path.read_text())
    failed = sum(r.get("failed", 0) or 0 for r in res["results"])
    served = [r for r in res["ratios"] if r["kind"].startswith("server")]
    return {"ok": proc.returncode == 0 and failed == 0, "failed_requests": failed, "ratios": served,
            "results": [{k: r.get(k) for k in ("target", "concurrency", "output_tokens_per_s", "ttft_p50",
                                                "itl_p50")} for r in res["results"]]}


def markdown(res: dict) -> str:
    k = res["kernels"]
    lines = [f"### gpu-check {res['date']} on {res['device']}", "",
             f"torch {res['torch']}, python {res['python']}; {'PASS' if res['ok'] else 'FAIL'} in {res['wall_s']:.0f} s",
             "", "| kernel | dtype | max abs err | ok |", "| --- | --- | ---: | --- |"]
    lines += [f"| {c['kernel']} ({c['detail']}) | {c['dtype']} | {c['max_abs_err']:.2e} | {'ok' if c['ok'] else 'FAIL'} |"
              for c in k.get("checks", [])]
    if "copy_bandwidth_gbs" in k:
        lines += ["", f"Copy bandwidth {k['copy_bandwidth_gbs']:.0f} GB/s.", "",
                  "| decode attention | us | % of copy bandwidth | splits |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| B={r['batch']} ctx={r['context']} | {r['us']:.1f} | {r['pct_copy']:.1f} | {r['splits']} |"
                  for r in k.get("decode_attention", [])]
        lines += ["", "| 8B-shaped decode step | ms | floor ms | % of floor | tok/s |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| B={r['batch']} ctx={r['context']} | {((r['graph_us'] or r['eager_us']) / 1e3):.2f} | "
                  f"{r['floor_us'] / 1e3:.2f} | {r['pct_of_floor']:.1f} | {r['tokens_per_s']:.0f} |"
                  for r in k.get("engine_decode_step", [])]
    g = res["greedy"]
    if "rows" in g:
        lines += ["", f"Greedy vs transformers ({g['dtype']}, near-tie {g['near_tie']}): "
                  + ", ".join(f"{r['same_until']}/{r['tokens']} exact (max gap {r['max_gap']:.3f})" for r in g["rows"])]
    s = res["served"]
    for r in s.get("ratios", []):
        lines.append(f"Served / in-process ({r['kind']}, concurrency {r['concurrency']}): {r['ratio']:.2f}x")
    for part in ("kernels", "greedy", "served"):
        if res[part].get("error"):
            lines.append(f"{part}: {res[part]['error']}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="results folder (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="rehearse on the CPU with tiny shapes")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("inflight gpu-check needs a CUDA GPU; --dry-run rehearses it on the CPU", file=sys.stderr)
        return 2
    p, device = (DRY, "cpu") if args.dry_run else (FULL, "cuda")
    env = dict(os.environ, TRITON_INTERPRET="1") if args.dry_run else dict(os.environ)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # the engine's Triton kernels run in this process: the interpreter must be chosen before
        # triton is imported, so rerun under it
        return subprocess.call([sys.executable, "-m", "kernels.gpu_check", *(argv or sys.argv[1:])], env=env)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    from backend.make_model import make_model

    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(0) if device == "cuda" else "CPU dry run (timings meaningless)",
               torch=torch.__version__, python=platform.python_version(), dry_run=args.dry_run)
    res["kernels"] = check_kernels(p, args.out, env)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", seed=3, **p["model"])
        try:
            res["greedy"] = check_greedy(p, model_dir, device)
        except Exception as exc:  # reported in the results; the other parts still run
            res["greedy"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        res["served"] = check_served(p, model_dir, args.out, env)
    res["ok"] = all(res[part]["ok"] for part in ("kernels", "greedy", "served"))
    res["wall_s"] = time.time() - start
    (args.out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    table = markdown(res)
    (args.out / "gpu_check.md").write_text(table)
    print("\n" + table + f"\nwrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
