"""What a served engine reports of itself (issue 47): its torch team's cores read back on the engine
thread (cpu_affinity.team_placement), and the one log line model.py writes with its effective
EngineConfig, which TritonServer.engine_reports reads back from a tritonserver log."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter_module import load_adapter
from backend.core.config import EngineConfig
from serving.triton_log import ENGINE_REPORT, engine_reports

ROOT = Path(__file__).resolve().parents[1]

TEAM_SCRIPT = """
import json, torch
from backend.worker.cpu_affinity import pin_omp_threads, team_placement
torch.set_num_threads(2)
before = team_placement()
pin_omp_threads(2)
print(json.dumps([before, team_placement()]))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin two threads")
def test_team_placement_reads_each_thread_of_the_team_back():
    cores = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", TEAM_SCRIPT], capture_output=True, text=True, cwd=ROOT,
                         env=env, check=True).stdout
    before, after = json.loads(out)
    every = sorted(os.sched_getaffinity(0))
    assert before == [every, every]  # a team of two, each free on every core
    assert after == [[cores[0]], [cores[1]]]  # each pinned to its own core


def test_engine_report_line_round_trips_through_both_log_formats():
    """The line as Triton's log writes it, plain and quoted (its quotes escaped), parses back to the
    config and team model.py gave it; a JSON value inside the config (quotes of its own) survives."""
    adapter = load_adapter()
    config = EngineConfig(model_path="/m/modèle", max_num_batched_tokens=1234,
                          kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq"},
                          enable_kv_cache_reuse=True)
    line = adapter.engine_report(config, [[0], [1]], 231_000)
    assert line.startswith(ENGINE_REPORT) and "\n" not in line
    quoted = json.dumps(line)  # "inflight: ...{\"config\": ...}"
    log = (f"I1203 15:00:00.000000 11 model.py:90] {line}\n"
           f"I1203 15:00:01.000000 11 model.py:92] {quoted}\n"
           f"I1203 15:00:02.000000 11 model.py:92] {json.dumps(line, ensure_ascii=False)}\n"
           "I1203 15:00:02.000000 11 server.cc:300] an unrelated line\n")
    plain, escaped, utf8 = engine_reports(log)
    for report in (plain, escaped, utf8):
        assert report["config"]["model_path"] == "/m/modèle"
        assert report["config"] == json.loads(json.dumps(dataclasses.asdict(config)))
        assert report["config"]["max_num_batched_tokens"] == 1234
        assert report["cpu_placement"] == [[0], [1]]
        assert report["frozen_objects"] == 231_000
    assert engine_reports("no report here\n") == []


def test_engine_report_names_the_openmp_environment(monkeypatch):
    adapter = load_adapter()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("INFLIGHT_CPU_PIN", "0")
    monkeypatch.setenv("UNRELATED_SETTING", "1")
    env = engine_reports(adapter.engine_report(EngineConfig(), [], 0))[0]["env"]
    assert env["OMP_NUM_THREADS"] == "3" and env["INFLIGHT_CPU_PIN"] == "0"
    assert "UNRELATED_SETTING" not in env
