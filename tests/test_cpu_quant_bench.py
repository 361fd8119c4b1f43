"""client.tools.benchmarks.cpu_quant (docs/performance.md's AVX2 table): every build computes the same
layer, the report has a row per format and row count, and bad arguments are refused by name."""
import json

import pytest

from client.tools.benchmarks import cpu_quant as cpu_quant_bench
from kernels.cpu import build as cpu_build
def test_a_tiny_run_reports_every_build(tmp_path, capsys):
    builds = ("avx2_autovec,avx2" if "avx2" in cpu_build._cpu_flags().split() else "portable,portable") + ",float32"
    out = tmp_path / "q.json"
    assert cpu_quant_bench.main(["--builds", builds, "--formats", "Q4_1,Q6_K", "--rows", "1,5", "--repeats", "2",
                                 "--min-time", "0.0001", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["qtype"], r["rows"]) for r in result["rows"]] == [("Q4_1", 1), ("Q4_1", 5), ("Q6_K", 1), ("Q6_K", 5)]
    for row in result["rows"]:
        assert row["projections"] == (["down"] if row["qtype"] == "Q6_K" else ["qkv", "o", "gate_up", "down"])
        assert row["max_abs_difference"] < 1e-3 and min(row["us"].values()) > 0 and len(row["us"]) == 3
    assert "Q6_K        5 down" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [(["--builds", "avx9"], "--builds: 'avx9'"),
                                          (["--formats", "Q2_K"], "--formats: 'Q2_K'"),
                                          (["--rows", "0"], "--rows: positive")])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        cpu_quant_bench.main(args)
    assert message in capsys.readouterr().err
