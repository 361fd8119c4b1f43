"""The served engine is the in-process engine (issue 47): a real tritonserver's `llm` stub logs its
effective EngineConfig and its engine thread's torch team, and both equal those of an AsyncEngine
built in a fresh process from the same parameters and environment (the served-gap tool, which
builds both, run end to end). Two threads where the machine has two cores: each pinned to its own
core in both, not left to float in the stub."""
import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT, requires_tritonserver

pytestmark = [requires_tritonserver, pytest.mark.slow]

PARAMS = {"max_model_len": "300", "max_num_batched_tokens": "96", "cpu_kv_cache_tokens": "2000"}


def test_served_gap_tool_runs_every_arm_on_one_config(tmp_path, model_path):
    """client/tools/benchmarks/served_gap.py end to end on the tiny model: the served engine's
    EngineConfig equals the in-process one's for the same parameters (which reached both), its
    torch team is the in-process one's (OMP_NUM_THREADS=2 where there are two cores: each thread
    pinned to its own core); every arm answers every figure with the tokens asked, and the summary
    has each figure's served / in-process ratios."""
    from client.tools.benchmarks.served_gap import served_config

    threads = min(2, len(os.sched_getaffinity(0)))
    out = tmp_path / "gap.json"
    run = subprocess.run([sys.executable, "-m", "client.tools.benchmarks.served_gap", "--model-path", str(model_path),
                          "--prompts", "40,21", "--decode", "8", "--threads", str(threads),
                          *(arg for key, value in PARAMS.items() for arg in ("--param", f"{key}={value}")),
                          "--json", str(out)],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "| figure | in_process | http / in_process | openai / in_process | CPU http / in_process |" in run.stdout
    assert result["config_differences"] == {}, "served EngineConfig differs from in-process for the same parameters"
    # the parameters reached both: the in-process config has them, and the served one equals it
    assert served_config(PARAMS, str(model_path.resolve())).max_num_batched_tokens == 96
    assert result["served_env"].get("OMP_NUM_THREADS") == str(threads)
    # the stub froze its heap once started (backend/core/gc_heap.py): torch, transformers and the model
    assert result["served_frozen_objects"] > 100_000, result["served_frozen_objects"]
    cores = sorted(os.sched_getaffinity(0))
    expected = [[c] for c in cores[:threads]] if threads > 1 else [cores]
    assert result["served_cpu_placement"] == result["in_process_cpu_placement"] == expected
    assert [t["arm"] for t in result["turns"]] == ["in_process", "http", "openai", "openai", "http", "in_process"]
    for turn in result["turns"]:
        figures = turn["figures"]
        assert [figures[f]["tokens"] for f in ("ttft_40", "ttft_21", "decode")] == [1, 1, 8], turn
        assert all(figures[f]["value"] > 0 for f in figures)
        assert figures["decode"]["threads"], "the engine's thread that decoded is not seen"
    for figure in ("ttft_40", "ttft_21", "decode"):
        row = result["summary"][figure]
        assert {"in_process", "http", "openai", "http/in_process", "openai/in_process", "cpu_in_process",
                "cpu_http/in_process"} <= set(row)
        assert row["http/in_process"] == pytest.approx(row["http"] / row["in_process"], abs=1e-3)
