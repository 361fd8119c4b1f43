"""client.tools.benchmarks.moe (docs/performance.md's MoE figure): both paths compute the same layer on
the same routed batch, every format, and the report says so; bad arguments are refused by name."""
import json

import pytest
import torch

from client.tools.benchmarks import moe as moe_bench
def test_a_tiny_run_reports_both_paths_equal(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert moe_bench.main(["--tokens", "3,7", "--hidden", "64", "--intermediate", "96", "--repeats", "1",
                           "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["tokens"], r["format"]) for r in result["rows"]] == [(t, f) for t in (3, 7) for f in moe_bench.FORMATS]
    for row in result["rows"]:
        assert sum(row["tokens_per_expert"]) == row["tokens"] * 2            # top-2: each token twice
        assert row["max_abs_difference"] < (1e-2 if row["format"] == "bfloat16" else 1e-5)
        assert row["per_expert_ms"] > 0 and row["one_call_ms"] > 0 and row["dense_ms"] > 0
    assert "| 7 | Q8_0 |" in capsys.readouterr().out


def test_the_4_bit_experts_grouped_equal_every_expert(tmp_path):
    """llama.cpp's Q4_0 and Q4_K experts (GGUF Mixtral / Qwen3-MoE), kept packed: both grouped paths
    (one QuantLinear per active expert; one CpuQuantExperts call per projection) give the every-
    expert result, and the read floor is the active experts' bytes over the bandwidth given."""
    out = tmp_path / "moe.json"
    assert moe_bench.main(["--tokens", "5", "--experts", "4", "--hidden", "256", "--intermediate", "512",
                           "--repeats", "1", "--formats", "Q4_0,Q4_K", "--read-gbs", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == ["Q4_0", "Q4_K"]
    for row in rows:
        assert row["max_abs_difference"] < 1e-5
        active = sum(c > 0 for c in row["tokens_per_expert"])
        # 4.5 bits a value (Q4_K's tiles: a byte of sub-scale and of sub-min per 32 values, 5 bits)
        per_value = 0.5625 if row["format"] == "Q4_0" else 0.5625 + 1.5 / 32 - 12 / 256
        assert row["weight_mb"] == pytest.approx(active * 3 * 256 * 512 * per_value / 1e6, abs=0.06)
        assert row["floor_ms"] == pytest.approx(row["weight_mb"] / 2, abs=0.03)   # MB rounded to 0.1


def test_random_4_bit_experts_spread_as_the_float_weights():
    """The stand-in GGUF experts' values: centred, spread k ** -0.5, as the float experts' are."""
    from kernels.quant_reference import dequantize
    for qtype in ("Q4_0", "Q4_K"):
        values = dequantize(qtype, moe_bench.random_packed(qtype, 32, 1024, torch.Generator().manual_seed(3)))
        assert abs(float(values.mean())) < 0.1 * 1024 ** -0.5
        assert float(values.std()) == pytest.approx(1024 ** -0.5, rel=0.05)


@pytest.mark.parametrize("args,message", [(["--tokens", "0"], "--tokens"), (["--formats", "fp4"], "--formats"),
                                          (["--top-k", "9"], "--top-k 9 exceeds"),
                                          (["--hidden", "40"], "Q8_0 needs --hidden"),
                                          (["--formats", "Q4_0,Q4_K", "--hidden", "288"],
                                           "Q4_K needs --hidden and --intermediate multiples of 256"),
                                          (["--read-gbs", "0"], "--read-gbs must be > 0")])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        moe_bench.main(args)
    assert message in capsys.readouterr().err
