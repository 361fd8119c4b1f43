"""`inflight gpu-check`: its real run needs a GPU, so the whole of it is rehearsed on the CPU
(--dry-run: tiny shapes, the Triton interpreter, a real local tritonserver with two instances),
including the device check, which must fail there: the instances serve from the CPU. Its greedy
check is shown to fail when the engine and transformers disagree, and its verdict to refuse a
dry run whose device check passed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from client.tools import gpu_check
from client.tools.gpu_check_served import device_check, kv_check, scrape, tokens_by_instance

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run([sys.executable, "-m", "client.cli", "gpu-check", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    report = (out / "gpu_check.md").read_text() if (out / "gpu_check.md").exists() else ""
    return proc, report


def results(report: str) -> dict:
    return json.loads(report.split("```json\n", 1)[1].rsplit("\n```", 1)[0])


def test_dry_run_passes_on_the_cpu_with_every_part(dry_run):
    proc, report = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = results(report)
    assert res["ok"] and res["dry_run"] and res["problems"] == []
    parts = res["parts"]
    assert {c["kernel"] for c in parts["kernels"]["checks"]} == {
        "decode_attention", "prefill_attention", "store_kv", "rms_norm", "rotary_embedding", "silu_mul"}
    greedy = parts["greedy"]
    assert [b["batch"] for b in greedy["batches"]] == [b for b, _, _ in gpu_check.DRY["greedy_batches"]]
    assert all(b["ok"] and b["tokens"] == b["batch"] * gpu_check.DRY["max_tokens"] for b in greedy["batches"])
    assert greedy["engine"]["kernels"] == "triton" and greedy["engine"]["dtype"] == "float32"
    decode = parts["decode"]["rows"]
    assert {(r["batch"], r["context"], r["graphs"]) for r in decode} == {
        (b, c, g) for b, c in gpu_check.DRY["decode_shapes"] for g in (True, False)}
    assert all(r["engine_ms"] > 0 and r["microbench_ms"] > 0 and r["floor_ms"] > 0 for r in decode)
    assert {r["weights"] for r in decode} == {"none"} and parts["decode"]["fp8"] == "skipped: the engine is on the CPU"
    served = parts["served"]
    assert served["kv"]["ok"] and served["requests"]["ok"] and served["throughput"]["ok"]
    tiers = parts["kv_tiers"]
    assert tiers["copies"]["exact"] and tiers["copies"]["blocks"] == gpu_check.DRY["tiers_copy_blocks"]
    assert tiers["chat"]["ok"] and tiers["chat"]["host"]["host_hits"] > 0
    for part in ("| kernels |", "Greedy vs transformers", "Engine decode step", "Served / in-process", "KV tiers:"):
        assert part in report, part


def test_the_dry_run_device_check_fails_the_cpu_served_instances(dry_run):
    """Both instances serve from the CPU: the check that reads their device label must say so."""
    _, report = dry_run
    devices = results(report)["parts"]["served"]["devices"]
    assert not devices["ok"] and devices["devices"] == {"llm_0_0": "cpu", "llm_0_1": "cpu"}
    assert "not on a GPU" in devices["reason"]


SERIES = """# HELP inflight_kv_blocks KV-cache blocks by state
inflight_kv_blocks{{device="{a}",instance="llm_0_0",model="llm",state="total",version="1"}} 900
inflight_kv_blocks{{device="{b}",instance="llm_0_1",model="llm",state="total",version="1"}} 90
inflight_kv_blocks{{device="{b}",instance="llm_0_1",model="llm",state="used",version="1"}} 0
"""


def test_device_check_reads_the_label_of_every_instance():
    assert device_check(scrape(SERIES.format(a="cuda:0", b="cuda:0")), 2)["ok"]
    one_on_cpu = device_check(scrape(SERIES.format(a="cuda:0", b="cpu")), 2)
    assert not one_on_cpu["ok"] and one_on_cpu["reason"] == "instances not on a GPU: {'llm_0_1': 'cpu'}"
    assert not device_check(scrape(SERIES.format(a="cuda:0", b="cuda:0")), 3)["ok"]    # one missing


def test_kv_check_wants_the_second_engine_sized_after_the_first():
    series = scrape(SERIES.format(a="cuda:0", b="cuda:0"))
    assert kv_check(series, 2**20, 2**40)["ok"]
    assert not kv_check(series, 2**30, 2**39)["ok"]                       # 990 GiB would not fit
    same = scrape(SERIES.format(a="cuda:0", b="cuda:0").replace(" 90\n", " 900\n"))
    assert not kv_check(same, 2**20, 2**40)["ok"] and kv_check(same, 2**20, 0)["ok"]   # equal: GPU only


def test_generated_tokens_are_summed_per_instance():
    page = ('inflight_generation_tokens_total{device="cpu",instance="llm_0_0",model="llm",version="1"} 40\n'
            'inflight_generation_tokens_total{device="cpu",instance="llm_0_1",model="llm",version="1"} 24\n'
            'inflight_prompt_tokens_total{device="cpu",instance="llm_0_1",model="llm",version="1"} 99\n')
    assert tokens_by_instance(scrape(page)) == {"llm_0_0": 40.0, "llm_0_1": 24.0}


def test_a_dry_run_whose_device_check_passed_is_refused():
    parts = {"served": {"devices": {"ok": True}, "kv": {"ok": True}}}
    ok, problems = gpu_check.verdict(parts, dry_run=True)
    assert not ok and "cannot tell a CPU-served instance" in problems[0]
    assert gpu_check.verdict(parts, dry_run=False) == (True, [])
    assert gpu_check.verdict({"served": {"devices": {"ok": False}}}, dry_run=True) == (True, [])
    assert not gpu_check.verdict({"served": {"ok": False, "error": "crashed"}}, dry_run=True)[0]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    from backend.make_model import make_model

    root = tmp_path_factory.mktemp("gpu-check-models")
    return [make_model(root / f"seed{seed}", seed=seed, **gpu_check.DRY["model"]) for seed in (3, 4)]


def test_greedy_check_fails_when_the_engine_and_transformers_disagree(two_checkpoints, monkeypatch):
    """transformers is handed other weights than the engine ran: the check must notice."""
    from transformers import AutoModelForCausalLM

    from client.tools.gpu_check_engine import greedy

    load = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, path, **kw: load(cls, str(two_checkpoints[1]), **kw)))
    plan = dict(gpu_check.DRY, greedy_batches=[(2, 5, 12)])
    res = greedy(plan, two_checkpoints[0], "cpu")
    assert not res["ok"] and res["batches"][0]["failed"] > 0 and res["batches"][0]["max_gap"] > plan["near_tie"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_real_run_refuses_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "client.tools.gpu_check", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


def test_the_dry_run_skips_the_tensor_parallel_run_and_says_so(dry_run):
    """Two GPUs are needed for the TP=2 (NCCL) part; the CPU has none: skipped, and the report says so."""
    _, report = dry_run
    tp = results(report)["parts"]["tp"]
    assert tp["ok"] and tp["skipped"] == "the TP=2 run (NCCL) needs two GPUs; this machine has 0"
    assert "| tp | skipped: the TP=2 run (NCCL) needs two GPUs; this machine has 0 |" in report
