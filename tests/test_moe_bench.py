"""client.tools.moe_bench (docs/performance.md's MoE figure): both paths compute the same layer on
the same routed batch, every format, and the report says so; bad arguments are refused by name."""
import json

import pytest

from client.tools import moe_bench


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


@pytest.mark.parametrize("args,message", [(["--tokens", "0"], "--tokens"), (["--formats", "fp4"], "--formats"),
                                          (["--top-k", "9"], "--top-k 9 exceeds"),
                                          (["--hidden", "40"], "Q8_0 needs --hidden")])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        moe_bench.main(args)
    assert message in capsys.readouterr().err
