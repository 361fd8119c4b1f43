"""gpu-check's served part (client/tools/gpu_check/run.py runs it in its own process):

1. A tritonserver with `instance_group [{ count: 2 kind: KIND_GPU gpus: [0] }]` (KIND_CPU where
   there is no GPU, as in the dry run): two engines on one GPU. The check reads the server's own
   metrics: every instance's `device` label must name a GPU (a KIND_GPU instance that fell back to
   the CPU fails here, whatever its throughput), both must hold KV blocks, and on a GPU the second
   engine must have sized its cache from what the first left (fewer blocks) with both caches
   fitting in the GPU's memory. A few requests go through so both instances serve.
2. In-flight throughput served through tritonserver against in-process, in one run
   (`python -m client.tools.benchmarks.bench --compare-server`).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from templates.exposition import parse_exposition

ROOT = Path(__file__).resolve().parents[3]


def scrape(text: str) -> list[tuple[str, dict, float]]:
    """Every inflight_* series of a Prometheus page: (name, labels, value)."""
    return [(s.name, s.labels, s.value) for s in parse_exposition(text) if s.name.startswith("inflight_")]


def tokens_by_instance(series: list[tuple[str, dict, float]]) -> dict[str, float]:
    """Tokens generated so far by each instance (its inflight_generation_tokens_total)."""
    generated: dict[str, float] = defaultdict(float)
    for name, labels, value in series:
        if name == "inflight_generation_tokens_total":
            generated[labels["instance"]] += value
    return dict(generated)


def device_check(series: list[tuple[str, dict, float]], expected_instances: int) -> dict:
    """Every instance of the `llm` model must report a GPU device label (cuda:N)."""
    devices = {labels["instance"]: labels.get("device", "") for name, labels, _ in series
               if name == "inflight_kv_blocks" and labels.get("model") == "llm"}
    not_gpu = {inst: dev for inst, dev in devices.items() if not dev.startswith("cuda:")}
    ok = len(devices) == expected_instances and not not_gpu
    reason = "" if ok else (f"instances not on a GPU: {not_gpu}" if not_gpu else
                            f"{len(devices)} instances reported, {expected_instances} expected")
    return dict(ok=ok, devices=devices, reason=reason)


def kv_check(series, bytes_per_block: int, gpu_total: int) -> dict:
    """Both engines hold KV blocks; on a GPU the second sized from what the first left."""
    total = {labels["instance"]: int(v) for name, labels, v in series
             if name == "inflight_kv_blocks" and labels.get("state") == "total" and labels.get("model") == "llm"}
    blocks = sorted(total.values(), reverse=True)
    ok = len(blocks) == 2 and blocks[-1] > 0
    res = dict(blocks=total, bytes_per_block=bytes_per_block)
    if gpu_total:   # one GPU: the caches fit together, and the second is smaller (it saw the first's)
        cache_bytes = sum(blocks) * bytes_per_block
        res.update(cache_gb=cache_bytes / 1e9, gpu_gb=gpu_total / 1e9, sequential=blocks[0] > blocks[-1])
        ok = ok and cache_bytes < gpu_total and blocks[0] > blocks[-1]
    return dict(res, ok=ok)


def served(plan: dict, model_dir: Path, on_gpu: bool) -> dict:
    import urllib.request

    import torch

    from backend.kv.sizing import kv_bytes_per_token
    from backend.models.loader import load_model_config
    from client.grpc_client import GrpcClient
    from serving.triton_launcher import TritonServer
    from templates.render import write_config

    cfg = load_model_config(str(model_dir))
    params = {k: str(v) for k, v in plan["server_params"].items()}
    dtype = torch.bfloat16 if on_gpu else torch.float32
    per_block = int(params.get("kv_block_size", "16")) * kv_bytes_per_token(cfg, dtype)
    gpu_total = torch.cuda.get_device_properties(0).total_memory if on_gpu else 0
    repo = Path(tempfile.mkdtemp(prefix="inflight-gpu-check-"))
    write_config(repo / "llm" / "config.pbtxt", gpus=[0] if on_gpu else [], count=2)
    (repo / "llm" / "1").symlink_to(ROOT / "model_repository" / "llm" / "1", target_is_directory=True)
    res: dict = {}
    with TritonServer(repo, params=params, model_path=str(model_dir)) as server:
        errors = []

        def send(i: int) -> None:
            try:
                with GrpcClient(server.grpc_url) as client:
                    client.generate([3 + i] * (5 + i), max_tokens=8, ignore_eos=True, temperature=0.0)
            except Exception as exc:  # reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        # Each instance writes its metrics from a thread of its own every stats interval, after the
        # responses went out: read them again until the counters have caught up (or 30 s pass).
        deadline = time.monotonic() + 30
        while True:
            series = scrape(urllib.request.urlopen(server.metrics_url, timeout=30).read().decode())
            generated = tokens_by_instance(series)
            if errors or sum(generated.values()) >= 8 * 8 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    res["devices"] = device_check(series, expected_instances=2)
    res["kv"] = kv_check(series, per_block, gpu_total)
    counted = sum(generated.values())
    reason = (f"{len(errors)} of 8 requests failed: {errors[:3]}" if errors else
              "" if counted == 8 * 8 else f"the instances counted {counted:g} tokens generated, 64 expected")
    res["requests"] = dict(ok=not reason, reason=reason, errors=errors[:3], tokens_by_instance=generated)
    res["throughput"] = _throughput(plan, model_dir)
    return res


def _throughput(plan: dict, model_dir: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "served_vs_in_process.json"
        cmd = [sys.executable, "-m", "client.tools.benchmarks.bench", "--compare-server", "--model-path", str(model_dir),
               "--output-json", str(path), "--no-progress", *plan["throughput"]]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if not path.exists():
            return dict(ok=False, error=f"bench exited {proc.returncode}: {proc.stderr[-800:]}")
        out = json.loads(path.read_text())
    failed = sum(r.get("failed", 0) or 0 for r in out["results"])
    ratios = [r for r in out["ratios"] if r["kind"].startswith("server")]
    return dict(ok=proc.returncode == 0 and failed == 0 and bool(ratios), failed_requests=failed, ratios=ratios,
                results=[{k: r.get(k) for k in ("target", "concurrency", "output_tokens_per_s", "ttft_p50", "itl_p50")}
                         for r in out["results"]])
