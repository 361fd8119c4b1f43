"""The quantized GEMMs in the ahead-of-time table (kernels.aot; tests/kernels/test_aot.py's aot_full
test, `make aot`, compiles the whole table): which variants an 8B model's projections launch, and
that FP8 is planned for sm_90 only because sm_80 refuses e4m3. Run in a subprocess without
TRITON_INTERPRET (the real compiler)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys
from kernels import aot
rows, jobs = aot.collect({m: aot.MODELS[m] for m in ("Llama-3.1-8B", "Qwen2-7B")}, ["bf16"], ["sm_80", "sm_90"])
quant = [(r, k) for r, k in zip(rows, jobs) if r["kernel"].endswith("gemm_kernel") or r["kernel"] == "split_k_reduce_kernel"]
def compile_first(kernel, target, **config):
    for r, k in quant:
        if r["kernel"] == kernel and r["target"] == target and all(r["config"].get(a) == v for a, v in config.items()):
            ok, shared, error, _ = aot._compile(jobs[k])
            return dict(ok=ok, shared=shared, error=error)
import torch
from kernels.gpu.quant_dispatch import aot_launches
launch = next(l for l in aot_launches({"o": (4096, 4096, False)}, torch.bfloat16) if l.constexprs.get("FP8"))
fp8_sm80 = (launch.kernel.fn.__module__, launch.kernel.fn.__name__, 80, *aot.specialize(launch, 80))
print(json.dumps(dict(rows=[r for r, _ in quant],
                      fp8_sm90=compile_first("w8_gemm_kernel", "sm_90", FP8=True, BLOCK_M=16),
                      awq_sm80=compile_first("awq_gemm_kernel", "sm_80", BLOCK_M=64, BLOCK_N=64),
                      fp8_sm80=dict(zip(("ok", "shared", "error"), aot._compile(fp8_sm80)[:3])))))
'''


@pytest.mark.slow
def test_quantized_gemm_variants_in_the_aot_table():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = res["rows"]
    by_kernel = {}
    for r in rows:
        by_kernel.setdefault((r["kernel"], r["target"]), []).append(r)
    # every GGUF type x the three tile regimes (decode <= 16 rows, decode <= 64, prefill), and the
    # prefill with Qwen2's qkv bias: batch sizes, split counts and K-quant scale strides add no binary
    for target in ("sm_80", "sm_90"):
        gguf = by_kernel[("gguf_gemm_kernel", target)]
        assert sorted({r["config"]["QTYPE"] for r in gguf}) == list(range(7))
        assert len(gguf) == 7 * 4
        assert {(r["config"]["BLOCK_M"], r["config"]["BLOCK_N"]) for r in gguf} == {(16, 64), (64, 64), (64, 128)}
        assert len(by_kernel[("awq_gemm_kernel", target)]) == 4
    # FP8 only where e4m3 exists: sm_90 (sm_80 refuses it, below); Q8_0/INT8 on both
    assert not [r for r in by_kernel[("w8_gemm_kernel", "sm_80")] if r["config"]["FP8"]]
    fp8 = [r for r in by_kernel[("w8_gemm_kernel", "sm_90")] if r["config"]["FP8"]]
    assert len(fp8) == 4 and all(r["config"]["PER_CHANNEL"] for r in fp8)
    assert res["fp8_sm90"]["ok"], res["fp8_sm90"]
    assert not res["fp8_sm80"]["ok"] and "fp8e4nv not supported" in res["fp8_sm80"]["error"]
    # AWQ's zeros and scales are read once per K tile: its decode tile fits sm_80's shared memory
    assert res["awq_sm80"]["ok"] and res["awq_sm80"]["shared"] <= 163 * 1024, res["awq_sm80"]
