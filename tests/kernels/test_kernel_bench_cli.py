"""client.tools.benchmarks.kernel_bench: the GPU benchmark script. Its GPU run cannot happen here, so check that it
imports without a GPU, that its command line parses, and that it saves its checks before its timings. The
whole script is rehearsed on the CPU (tiny shapes, the Triton interpreter, its command line, every
section and the engine step) by gpu-check's dry run, whose kernels part runs it: its JSON is checked
in tests/kernels/test_gpu_check.py, so a broken code path fails there rather than on the GPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from client.tools.benchmarks import kernel_bench as bench
ROOT = Path(__file__).resolve().parents[2]


def test_help_runs_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "client.tools.benchmarks.kernel_bench", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--out" in out.stdout and "copy bandwidth" in out.stdout


def test_parse_args():
    args = bench.parse_args(["--out", "r.json", "--batches", "2,8", "--contexts", "512", "--block-size", "32"])
    assert (args.out, args.batches, args.contexts, args.block_size) == ("r.json", [2, 8], [512], 32)
    assert bench.parse_args([]).batches == [1, 16, 64]
    assert bench.parse_args([]).contexts == [256, 1024, 4096]
    with pytest.raises(SystemExit):
        bench.parse_args(["--batches", "one"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--contexts", "0"])


@pytest.mark.slow
def test_the_checks_are_saved_before_the_timings_and_the_tuning_sweep_can_be_skipped(tmp_path, monkeypatch):
    """gpu-check cuts a part that overruns its budget: the kernel checks must already be on disk
    (partial: true) when the timings start; --skip-tuning leaves out the sweep's own variants."""
    out = tmp_path / "bench.json"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(bench, "P", bench.P)          # main() sets it: restored after the test
    seen = {}

    def stop_at_the_timings(*args, **kwargs):
        seen.update(json.loads(out.read_text()))
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "bench_kernels", stop_at_the_timings)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--dry-run-cpu", "--out", str(out), "--batches", "1", "--contexts", "40", "--skip-engine"])
    assert seen["partial"] is True and seen["failed_checks"] == 0 and seen["checks"] and seen["quant_checks"]
    assert "kernels" not in seen and not (tmp_path / "bench.json.tmp").exists()   # each save replaced whole
    monkeypatch.undo()
    args = bench.parse_args(["--skip-tuning"])
    assert args.skip_tuning and not bench.parse_args([]).skip_tuning


def test_the_fp8_cache_checks_run_and_pass_their_attention_rows(monkeypatch):
    """gpu-check's fp8 KV cache rows (GPUs of sm_89+ only) rehearsed here in float16 with the
    interpreter: both attentions reading an e4m3 cache agree with the references. The store's
    rounding row is only meaningful on the GPU (the interpreter's f32 -> e4m3 conversion is wrong at
    powers of two: tests/kernels/test_kernel_fp8_kv.py), so here it is only seen to run."""
    import torch

    from kernels import reference


    from kernels.gpu import triton_ops
    monkeypatch.setattr(bench, "P", bench.DRY)
    rows = bench.fp8_cache_checks(triton_ops, reference, 16, dtype=torch.float16)
    assert [r["kernel"] for r in rows] == ["decode_attention", "decode_attention", "prefill_attention", "store_kv"]
    assert all(r["ok"] for r in rows if r["kernel"] != "store_kv"), rows
    assert all(r["dtype"] == "float16, fp8 KV cache" for r in rows)
