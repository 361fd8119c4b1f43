"""The served engine is the in-process engine (issue 47): a real tritonserver's `llm` stub logs its
effective EngineConfig and its engine thread's torch team, and both equal those of an AsyncEngine
built in a fresh process from the same parameters and environment (what the served-gap tool runs
beside the server). Two threads where the machine has two cores: each pinned to its own core in
both, not left to float in the stub."""
import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT, cpu_repository, requires_tritonserver

pytestmark = [requires_tritonserver, pytest.mark.slow]

PARAMS = {"max_model_len": "300", "max_num_batched_tokens": "96", "cpu_kv_cache_tokens": "2000"}

IN_PROCESS = """
import dataclasses, json, sys
from backend.engine.async_engine import AsyncEngine
from client.tools.benchmarks.served_gap import served_config
config = served_config(json.loads(sys.argv[1]), sys.argv[2])
engine = AsyncEngine(config)
print(json.dumps({"config": dataclasses.asdict(config), "cpu_placement": engine.cpu_placement}))
engine.shutdown()
"""


def test_served_engine_has_the_in_process_config_and_threads(tmp_path, model_path):
    from serving.triton_launcher import TritonServer

    threads = min(2, len(os.sched_getaffinity(0)))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    repo = cpu_repository(tmp_path / "repo")
    with TritonServer(repo, params=PARAMS, model_path=str(model_path), env=env) as server:
        (served,) = server.engine_reports()
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, json.dumps(PARAMS), str(model_path.resolve())],
                         capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    local = json.loads(out.stdout.strip().splitlines()[-1])
    differ = {k: (v, local["config"].get(k)) for k, v in served["config"].items() if local["config"].get(k) != v}
    assert not differ, f"served EngineConfig differs from in-process for the same parameters: {differ}"
    assert served["config"]["max_num_batched_tokens"] == 96  # the parameters reached both
    assert served["cpu_placement"] == local["cpu_placement"]
    assert served["env"].get("OMP_NUM_THREADS") == str(threads)
    cores = sorted(os.sched_getaffinity(0))
    expected = [[c] for c in cores[:threads]] if threads > 1 else [cores]
    assert served["cpu_placement"] == expected


def test_served_gap_tool_runs_every_arm_on_one_config(tmp_path, model_path):
    """client/tools/benchmarks/served_gap.py end to end on the tiny model: every arm answers every
    figure with the tokens asked, the served engine's config and threads equal the in-process one's,
    and the summary has each figure's served / in-process ratios."""
    out = tmp_path / "gap.json"
    run = subprocess.run([sys.executable, "-m", "client.tools.benchmarks.served_gap", "--model-path", str(model_path),
                          "--prompts", "40,21", "--decode", "8", "--param", "max_model_len=300",
                          "--param", "cpu_kv_cache_tokens=2000", "--json", str(out)],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "| figure | in_process | http / in_process | openai / in_process | CPU http / in_process |" in run.stdout
    assert result["config_differences"] == {}
    assert result["served_cpu_placement"] == result["in_process_cpu_placement"] != []
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
