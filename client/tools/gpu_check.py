"""`inflight gpu-check`: the GPU acceptance run. One command, one report file, under 10 minutes on
an H100/H200 (each part has a time budget; the run stops a part that overruns it):

    inflight gpu-check --out gpu-check/        (or: make gpu-check; in the image:
    docker run --gpus all --rm -v $PWD:/workspace --entrypoint inflight inflight gpu-check --out /workspace/gpu-check)

Parts, each in its own process (budget in seconds):
  environment (in-process) torch sees CUDA; transformers, tritonclient and a tritonserver are there.
  kernels (150)  every Triton kernel against its torch reference in bf16, fp16 and fp32; decode
                 attention at batch 1/64/256 x context 1k/4k/16k against the copy bandwidth
                 (`python -m client.tools.kernel_bench`, Llama-3-8B heads).
  greedy (150)   a Llama-shaped checkpoint (head_dim 128, GQA 32/8, 16 layers, bf16) on cuda:N (the
                 last GPU): the engine's greedy tokens at batch 1 (a 16k prompt), 64 and 256 against
                 transformers in float32, teacher-forced (client/tools/gpu_check_engine.py).
  decode (150)   the engine's real decode step at (1, 16k), (64, 4k), (256, 1k), CUDA graphs on and
                 off, against the bandwidth floor and beside the CUDA-graphed microbenchmark.
  served (150)   tritonserver with two engines on GPU 0 (count: 2): every instance's `device` metric
                 label must name a GPU, the second engine sized from what the first left; then
                 served vs in-process throughput (client/tools/gpu_check_served.py).
  tp (120)       with two GPUs: the engine at tensor_parallel_size 2 (NCCL, cuda:0 + cuda:1) against
                 one rank on cuda:0, greedy on 16 prompts (equal, or a first difference at a near-tie),
                 and the decode step of each (client/tools/gpu_check_tp.py); with fewer GPUs it is
                 skipped and the report says so.
  kv_tiers (90)  the KV tiers' copies: pinned host pool, own stream, blocks saved and loaded back bit
                 for bit, their bandwidth; a multi-turn chat with the host tier and without, its
                 returning turns' TTFT (client/tools/gpu_check_tiers.py).

It writes DIR/gpu_check.md: the tables (to paste into docs/performance.md) and every result as
JSON. Exit 1 if a check failed. `--dry-run` rehearses every part on the CPU with tiny shapes
(Triton kernels under TRITON_INTERPRET=1; timings mean nothing). There, by design, the device check
must FAIL (the instances serve from the CPU): the dry run passes only if it does.
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

ROOT = Path(__file__).resolve().parents[2]
TOTAL_BUDGET_S = 570
LLAMA_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=16896,
                   rope_theta=500000.0, torch_dtype="bfloat16")
FULL = dict(
    model=LLAMA_SHAPE,
    kernels=["--batches", "1,64,256", "--contexts", "1024,4096,16384", "--skip-engine", "--skip-reference",
             "--iters", "20"],
    greedy_batches=[(1, 15000, 16000), (64, 256, 4096), (256, 32, 512)], max_tokens=32, near_tie=0.125,
    expected_dtype="bfloat16", attention_backend="auto", max_num_batched_tokens=8192, max_model_len=16896,
    decode_shapes=[(1, 16384), (64, 4096), (256, 1024)], decode_steps=20,
    server_params={"max_num_seqs": 64, "max_num_batched_tokens": 4096},
    throughput=["--num-requests", "256", "--concurrency", "64", "--max-output-len", "128"],
    budgets=dict(kernels=150, greedy=150, decode=150, served=150, tp=120, kv_tiers=90),
    tiers_copy_blocks=512, tiers_kv_tokens=4096, tiers_concurrency=8, tiers_conversations=32, tiers_turns=3,
    tiers_system_tokens=512, tiers_host_blocks=2048,
)
DRY = dict(
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512),
    kernels=["--dry-run-cpu", "--batches", "1,2", "--contexts", "40", "--skip-engine", "--skip-reference"],
    greedy_batches=[(1, 60, 80), (3, 5, 40), (5, 3, 20)], max_tokens=6, near_tie=1e-3, expected_dtype="float32",
    attention_backend="triton", max_num_batched_tokens=48, max_model_len=256,
    decode_shapes=[(1, 40), (3, 20)], decode_steps=3,
    server_params={"max_num_seqs": 8, "cpu_kv_cache_tokens": 2048},
    throughput=["--num-requests", "6", "--concurrency", "3", "--max-output-len", "8", "--warmup", "0"],
    budgets=dict(kernels=600, greedy=600, decode=600, served=600, tp=600, kv_tiers=600),
    tiers_copy_blocks=8, tiers_kv_tokens=160, tiers_concurrency=2, tiers_conversations=4, tiers_turns=2,
    tiers_system_tokens=20, tiers_host_blocks=64,
)
PARTS = ("kernels", "greedy", "decode", "served", "tp", "kv_tiers")
# What must fail in the dry run: the instances serve from the CPU, and the device check says so.
EXPECTED_ON_CPU = {("served", "devices")}


def environment(dry_run: bool) -> dict:
    import importlib.util

    import torch

    missing = [m for m in ("transformers", "tritonclient") if importlib.util.find_spec(m) is None]
    try:
        from client.tools.server import find_tritonserver
        server = str(find_tritonserver().binary)
    except Exception as exc:  # reported: the served part cannot run
        server, missing = None, missing + [f"tritonserver ({exc})"]
    res = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
               tritonserver=server, missing=missing, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        res["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        res["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    import triton
    res["triton"] = triton.__version__
    res["ok"] = not missing and (dry_run or res["cuda_available"])
    return res


def run_part(name: str, dry_run: bool, work: Path) -> dict:
    """One part, in this (child) process; its result goes to work/NAME.json."""
    import torch

    plan = DRY if dry_run else FULL
    model_dir = work / "model"
    last_gpu = f"cuda:{torch.cuda.device_count() - 1}" if not dry_run else "cpu"
    if name == "kernels":
        from client.tools import kernel_bench as bench
        path = work / "kernel_bench.json"
        code = bench.main(["--out", str(path), *plan["kernels"]])
        res = json.loads(path.read_text()) if path.exists() else {}
        res["ok"] = code == 0 and res.get("failed_checks", 1) == 0
    elif name == "greedy":
        from client.tools.gpu_check_engine import greedy
        res = greedy(plan, model_dir, last_gpu)
    elif name == "decode":
        from client.tools.gpu_check_engine import decode
        res = decode(plan, model_dir, "cpu" if dry_run else "cuda:0")
    elif name == "served":
        from client.tools.gpu_check_served import served
        res = served(plan, model_dir, on_gpu=not dry_run)
        res["ok"] = all(check["ok"] for check in res.values() if isinstance(check, dict))
    elif name == "tp":
        from client.tools.gpu_check_tp import tensor_parallel
        res = tensor_parallel(plan, model_dir)
    elif name == "kv_tiers":
        from client.tools.gpu_check_tiers import kv_tiers
        res = kv_tiers(plan, model_dir, "cpu" if dry_run else "cuda:0")
    else:
        raise ValueError(f"unknown part {name}")
    (work / f"{name}.json").write_text(json.dumps(res, default=str))
    return res


def verdict(parts: dict, dry_run: bool) -> tuple[bool, list[str]]:
    """Every check passes (a part's sub-checks, else the part); in the dry run the checks that
    cannot pass on a CPU must fail, or they could not tell the CPU from a GPU."""
    problems = []
    for name, res in parts.items():
        checks = {k: v for k, v in res.items() if isinstance(v, dict) and "ok" in v} or {None: res}
        for check, value in checks.items():
            label = name + (f".{check}" if check else "")
            if dry_run and (name, check) in EXPECTED_ON_CPU:
                if value["ok"]:
                    problems.append(f"{label}: passed on the CPU, so it cannot tell a CPU-served instance from a GPU one")
            elif not value.get("ok"):
                problems.append(f"{label}: {value.get('error') or value.get('reason') or 'failed'}")
    if dry_run:
        problems += [f"{n}.{c}: not run" for n, c in EXPECTED_ON_CPU if c not in parts.get(n, {})]
    return not problems, problems


def markdown(res: dict) -> str:
    env, parts = res["environment"], res["parts"]
    lines = [f"### gpu-check {res['date']} on {res['device']}", "",
             f"torch {env.get('torch')} (CUDA {env.get('cuda')}), triton {env.get('triton')}, python {env.get('python')}; "
             f"{'PASS' if res['ok'] else 'FAIL'} in {res['wall_s']:.0f} s", "",
             "| part | result | seconds | budget |", "| --- | --- | ---: | ---: |"]
    for name in PARTS:
        p = parts.get(name, {})
        result = "ok" if p.get("ok") else "FAIL"
        if p.get("skipped"):
            result = f"skipped: {p['skipped']}"
        if res["dry_run"] and not p.get("ok") and not any(x.startswith(name) for x in res["problems"]):
            result = "ok (its device check failed, as it must on a CPU)"
        lines.append(f"| {name} | {result} | {p.get('seconds', 0):.0f} | {p.get('budget', 0)} |")
    lines += [f"- {p}" for p in res["problems"]]
    k = parts.get("kernels", {})
    if k.get("checks"):
        lines += ["", "| kernel | dtype | max abs err | ok |", "| --- | --- | ---: | --- |"]
        lines += [f"| {c['kernel']} ({c['detail']}) | {c['dtype']} | {c['max_abs_err']:.2e} | {'ok' if c['ok'] else 'FAIL'} |"
                  for c in k["checks"]]
        lines += ["", f"Copy bandwidth {k.get('copy_bandwidth_gbs', 0):.0f} GB/s.", "",
                  "| decode attention (8B heads) | us | % of copy bandwidth | splits |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| B={r['batch']} ctx={r['context']} | {r['us']:.1f} | {r['pct_copy']:.1f} | {r['splits']} |"
                  for r in k.get("decode_attention", [])]
    g = parts.get("greedy", {})
    if g.get("batches"):
        e = g["engine"]
        lines += ["", f"Greedy vs transformers float32 on {e['device']} ({e['dtype']}, graphs {e['graphs']}, "
                      f"near-tie {g['near_tie']}):", "",
                  "| batch | prompt tokens | all exact | shortest exact prefix | max gap | failed |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {b['batch']} | {b['prompt_tokens'][0]}-{b['prompt_tokens'][1]} | {b['all_exact']}/{b['batch']} | "
                  f"{b['exact_prefix_min']} | {b['max_gap']:.3f} | {b['failed']} |" for b in g["batches"]]
    d = parts.get("decode", {})
    if d.get("rows"):
        lines += ["", f"Engine decode step (LLMEngine.step), {d['weight_gb']:.2f} GB of weights, copy bandwidth "
                      f"{d['copy_bandwidth_gbs']:.0f} GB/s:", "",
                  "| batch | context | weights | graphs | engine ms | microbench ms | floor ms | % of floor | tok/s |",
                  "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['batch']} | {r['context']} | {r.get('weights', 'none')} | {'on' if r['graphs'] else 'off'} | {r['engine_ms']:.2f} | "
                  f"{(r['microbench_ms'] or 0):.2f} | {r['floor_ms']:.2f} | {r['pct_of_floor']:.1f} | {r['tokens_per_s']:.0f} |"
                  for r in d["rows"]]
        lines += ["", f"quantization=fp8: {d.get('fp8', 'not run')} (the fp8 rows' floor counts their own bytes)."]
    s = parts.get("served", {})
    if "devices" in s:
        lines += ["", f"Served, two instances on one device: devices {s['devices']['devices']} "
                      f"({'ok' if s['devices']['ok'] else 'NOT ALL ON A GPU'}); KV blocks {s['kv'].get('blocks')}"]
        for r in s.get("throughput", {}).get("ratios", []):
            lines.append(f"Served / in-process ({r['kind']}, concurrency {r['concurrency']}): {r['ratio']:.2f}x")
    t = parts.get("tp", {})
    if t.get("tp2"):
        flips = len(t["near_tie_flips"])
        lines += ["", f"Tensor parallelism, {t['gpus']} GPUs: TP=2 (NCCL) vs one rank, greedy on {t['prompts']} prompts: "
                      f"{t['same']} identical, {flips} first differ at a near-tie (<= {t['near_tie']}), "
                      f"{len(t['not_near_tie'])} elsewhere.", "",
                  "| ranks | decode step ms (16 rows) | CUDA graphs | load s |", "| ---: | ---: | --- | ---: |"]
        lines += [f"| {n} | {t[k]['step_ms']:.2f} | {t[k]['graphs']} | {t[k]['load_s']} |" for n, k in ((1, "tp1"), (2, "tp2"))]
    kv = parts.get("kv_tiers", {})
    if kv.get("copies"):
        c, h = kv["copies"], kv["chat"]
        lines += ["", f"KV tiers: {c['blocks']} blocks of {c['block_bytes']} bytes saved to the host and loaded back "
                      f"{'bit-exact' if c['exact'] else 'WRONG'} (pinned {c['pinned']}, own stream {c['own_stream']}): "
                      f"save {c['save_gbs']} GB/s, load {c['load_gbs']} GB/s. Chat: returning turns' TTFT p50 "
                      f"{h['none']['returning_ttft_p50_ms']} ms without tiers, {h['host']['returning_ttft_p50_ms']} ms "
                      f"with ({h['ttft_speedup']}x), host hits {h['host']['host_hits']}, answers equal {h['answers_equal']}."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="results folder (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="rehearse on the CPU with tiny shapes")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)      # a child process: one part
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        run_part(args.part, args.dry_run, args.work)
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("inflight gpu-check needs a CUDA GPU; --dry-run rehearses it on the CPU", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"   # the parts' Triton kernels run on the CPU, chosen before triton loads
    plan = DRY if args.dry_run else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(0) if not args.dry_run else "CPU dry run (timings meaningless)",
               dry_run=args.dry_run, environment=environment(args.dry_run), parts={})
    with tempfile.TemporaryDirectory(prefix="inflight-gpu-check-") as tmp:
        work = Path(tmp)
        from backend.make_model import make_model

        make_model(work / "model", seed=3, **plan["model"])
        deadline = start + (TOTAL_BUDGET_S if not args.dry_run else 3600)
        for name in PARTS:
            budget = plan["budgets"][name]
            limit = min(budget, deadline - time.time())
            t0 = time.time()
            cmd = [sys.executable, "-m", "client.tools.gpu_check", "--part", name, "--work", str(work)]
            print(f"$ {' '.join(cmd[2:])}   (budget {budget} s)", flush=True)
            try:
                proc = subprocess.run(cmd + (["--dry-run"] if args.dry_run else []), cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=max(limit, 1))
                path = work / f"{name}.json"
                part = json.loads(path.read_text()) if path.exists() else \
                    dict(ok=False, error=f"exited {proc.returncode}: {proc.stderr[-1500:]}")
            except subprocess.TimeoutExpired:
                part = dict(ok=False, error=f"stopped after {limit:.0f} s (budget {budget} s)")
            part.update(seconds=time.time() - t0, budget=budget)
            res["parts"][name] = part
            print(f"  {name}: {'ok' if part['ok'] else 'FAIL'} in {part['seconds']:.0f} s", flush=True)
    res["ok"], res["problems"] = verdict(res["parts"], args.dry_run)
    res["ok"] = res["ok"] and res["environment"]["ok"]
    res["wall_s"] = time.time() - start
    report = markdown(res) + "\n```json\n" + json.dumps(res, indent=1, default=str) + "\n```\n"
    (args.out / "gpu_check.md").write_text(report)
    print("\n" + markdown(res) + f"\nwrote {args.out / 'gpu_check.md'}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
