"""`inflight gpu-check`: its real run needs a GPU, so the whole script is rehearsed on the CPU
(--dry-run: tiny shapes, the Triton interpreter, a real local tritonserver), and its greedy check is
shown to fail when the engine and transformers disagree."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_passes_on_the_cpu(tmp_path):
    out = tmp_path / "gpu-check"
    proc = subprocess.run([sys.executable, "-m", "client.cli", "gpu-check", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["ok"] and res["dry_run"]
    kernels = res["kernels"]
    assert {c["kernel"] for c in kernels["checks"]} == {"decode_attention", "prefill_attention", "store_kv",
                                                        "rms_norm", "rotary_embedding", "silu_mul"}
    assert kernels["copy_bandwidth_gbs"] > 0 and kernels["decode_attention"] and kernels["engine_decode_step"]
    greedy = res["greedy"]["rows"]
    assert len(greedy) == gpu_check.DRY["prompts"] and all(r["tokens"] == gpu_check.DRY["max_tokens"] for r in greedy)
    assert res["served"]["failed_requests"] == 0 and res["served"]["ratios"]
    table = (out / "gpu_check.md").read_text()
    for part in ("| decode_attention", "decode step", "Greedy vs transformers", "Served / in-process"):
        assert part in table, part


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    from backend.make_model import make_model

    root = tmp_path_factory.mktemp("gpu-check-models")
    return [make_model(root / f"seed{seed}", seed=seed, **gpu_check.DRY["model"]) for seed in (3, 4)]


def test_greedy_check_fails_when_the_engine_and_transformers_disagree(two_checkpoints, monkeypatch):
    """transformers is handed other weights than the engine ran: the check must notice."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, path, **kw: load(cls, str(two_checkpoints[1]), **kw)))
    res = gpu_check.check_greedy(dict(gpu_check.DRY, prompts=2), two_checkpoints[0], "cpu")
    assert not res["ok"] and any(r["max_gap"] > gpu_check.DRY["near_tie"] for r in res["rows"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_real_run_refuses_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kernels.gpu_check", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
