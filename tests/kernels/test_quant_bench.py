"""kernels/gpu/quant_bench.py, the quantized GEMMs' part of `inflight gpu-check`, rehearsed on the CPU
(interpreter, tiny shapes): its checks pass on the kernels and catch results off by 1% of their
scale; a failed one fails `python -m client.tools.benchmarks.kernel_bench`; its benchmark rows carry the bandwidth floor."""
import json

import pytest
import torch

from kernels.gpu import quant_bench

from kernels.gpu import quant_dispatch
def test_checks_pass_on_the_kernels_and_cover_every_interpretable_qtype():
    rows = quant_bench.checks("cpu", dry=True)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["detail"].split()[0] for r in rows} == set(quant_dispatch.QTYPES) - {"FP8"}
    assert all(0 <= r["bound_ratio"] <= 1 for r in rows)


def test_checks_fail_when_a_kernel_result_is_off(monkeypatch):
    real = quant_dispatch.quant_launches

    def off(x, qtype, parts, bias=None):       # the kernel's result, nudged by 1% of its scale
        out, plans = real(x, qtype, parts, bias)

        def nudge():
            out.add_(0.01 * out.float().abs().amax().to(out.dtype))
        return out, [*plans, nudge]

    monkeypatch.setattr(quant_dispatch, "quant_launches", off)
    rows = quant_bench.checks("cpu", dry=True)
    assert rows and not any(r["ok"] for r in rows)
    assert "0/" in quant_bench.markdown(rows, [])[0]


def test_bench_rows_and_table():
    def timer(fn, iters, warmup=1):
        fn()
        return 100.0
    rows = quant_bench.bench(timer, copy_gbs=50.0, iters=1, device="cpu", dry=True, log=None)
    assert {(r["qtype"], r["m"]) for r in rows} == {(q, m) for q in quant_bench.DRY["qtypes"] for m in quant_bench.DRY["rows"]}
    for r in rows:
        weight = sum(t.numel() * t.element_size() for t in quant_bench.random_parts(r["qtype"], r["n"], r["k"], "cpu",
                                                                                     torch.Generator()).values())
        assert r["weight_mb"] == pytest.approx(weight / 1e6)
        floor_us = (weight + (r["m"] * r["k"] + r["m"] * r["n"]) * 2) / 50e3
        assert r["floor_us"] == pytest.approx(floor_us) and r["pct_of_floor"] == pytest.approx(floor_us)
    table = quant_bench.markdown([], rows)
    assert sum(line.startswith("| o 72x256 |") for line in table) == len(rows)


def test_a_failed_quantized_check_fails_the_kernel_benchmark(monkeypatch, tmp_path):
    """client.tools.benchmarks.kernel_bench (what gpu-check runs) counts the quantized checks among its failures."""
    from client.tools.benchmarks import kernel_bench as bench
    bad = dict(kernel="quant_linear", dtype="float16", detail="Q4_0 M=5", max_abs_err=1.0, bound_ratio=9.0, ok=False)
    monkeypatch.setattr(quant_bench, "checks", lambda device, dry=False: [bad])
    monkeypatch.setattr(quant_bench, "bench", lambda *args, **kwargs: [])
    for name in ("run_checks", "bench_kernels"):          # the other kernels' parts, not under test here
        monkeypatch.setattr(bench, name, lambda *args, **kwargs: [])
    monkeypatch.setattr(bench, "bench_decode", lambda *args, **kwargs: ([], []))
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run-cpu", "--skip-engine", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["failed_checks"] == 1


@pytest.mark.parametrize("plan", ["FULL", "DRY"])
def test_every_qtype_can_be_made_at_the_planned_shapes(plan):
    """The GPU run's shapes (FULL: the check matrix and every benchmarked projection) are valid for
    every qtype it names: the first H200 run died on AWQ at N=300 (AWQ packs 8 outputs a word),
    which the CPU rehearsal's N=40 could not show. Made on the CPU from the same code."""
    p = getattr(quant_bench, plan)
    gen = torch.Generator().manual_seed(0)
    n, k = p["check_shape"]
    for qtype in {q for qtypes in p["check_dtypes"].values() for q in qtypes}:
        parts = quant_bench.random_parts(qtype, n, k, "cpu", gen)
        assert quant_bench.dequantize(qtype, parts).shape == (n, k), qtype
    for n, k in p["projections"].values():   # (too large to make here): AWQ's words, K super-blocks
        assert n % 8 == 0 and k % 256 == 0, (n, k)
