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
