"""`inflight bench` and the Locust file against the real local tritonserver (the session's server
from conftest.py), short and bounded: any failed request fails the test."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from client.tools.benchmarks import bench
from .conftest import REPO_ROOT, requires_tritonserver

pytestmark = requires_tritonserver

SMALL = ["--workload", "fixed", "--fixed-prompt-len", "24", "--fixed-output-len", "8", "--warmup", "1",
         "--no-progress"]


def _check(result: dict, n: int) -> None:
    for key in bench.METRIC_KEYS:
        assert key in result, key
    assert result["completed"] == n and result["failed"] == 0, result.get("errors")
    assert result["output_tokens"] == 8 * n
    assert result["output_tokens_per_s"] > 0 and result["ttft_p50_s"] <= result["e2e_p99_s"]


def test_bench_over_grpc_reports_the_servers_mode_and_writes_json_csv_png(server, tmp_path):
    out = tmp_path / "grpc.json"
    rc = bench.main(["--url", server.grpc_url, "--metrics-url", server.metrics_url, *SMALL,
                     "--num-requests", "12", "--concurrency", "1,4", "--output-json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(r["target"], r["mode"], r["concurrency"]) for r in data["results"]] == [
        ("server-grpc", "inflight", 1), ("server-grpc", "inflight", 4)]
    for r in data["results"]:
        _check(r, 12)
        assert r["itl_p50_s"] is not None  # streamed: one response per step
        assert r["kv_usage_peak"] is not None and r["preemptions"] == 0  # from the metrics endpoint
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert len(rows) == 2 and float(rows[1]["output_tokens_per_s"]) > 0
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_bench_over_http(server, tmp_path):
    out = tmp_path / "http.json"
    rc = bench.main(["--url", server.http_url, "--protocol", "http", "--metrics-url", server.metrics_url,
                     *SMALL, "--num-requests", "6", "--concurrency", "3", "--output-json", str(out)])
    assert rc == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["target"] == "server-http"
    _check(r, 6)


def test_compare_server_measures_both_in_one_run(server, model_path, tmp_path, capsys):
    out = tmp_path / "compare.json"
    rc = bench.main(["--compare-server", "--model-path", str(model_path), "--url", server.grpc_url,
                     "--metrics-url", server.metrics_url, *SMALL, "--num-requests", "8",
                     "--concurrency", "4", "--repeats", "2", "--also-no-stream", "--output-json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    # A B C C B A: load drift on the shared machine hits every target alike; ratios use the means
    assert [(r["target"], r["repeat"]) for r in data["results"]] == [
        ("in-process", 0), ("server-grpc", 0), ("server-grpc-nostream", 0),
        ("server-grpc-nostream", 1), ("server-grpc", 1), ("in-process", 1)]
    for r in data["results"]:
        _check(r, 8)
    printed = capsys.readouterr().out
    for kind in ("server-grpc/in-process", "server-grpc-nostream/in-process"):
        (ratio,) = [x for x in data["ratios"] if x["kind"] == kind]
        assert ratio["ratio"] > 0
        assert kind in printed


def test_a_bounded_headless_locust_run_has_no_failures(server, tmp_path):
    prefix = tmp_path / "locust"
    env = dict(os.environ, INFLIGHT_GRPC_URL=server.grpc_url, INFLIGHT_WORKLOAD="fixed",
               INFLIGHT_MAX_TOKENS="8", PYTHONPATH=str(REPO_ROOT))
    locust = Path(sys.executable).with_name("locust")
    cmd = [str(locust), "-f", str(REPO_ROOT / "client" / "tools" / "load" / "locustfile.py"), "--headless", "-u", "4", "-r", "4",
           "-t", "4s", "--stop-timeout", "30", "--host", f"http://{server.http_url}", "--csv", str(prefix),
           "--only-summary", "--loglevel", "WARNING"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(f"{prefix}_stats.csv"))}
    for key in [("grpc", "generate_stream"), ("grpc", "time_to_first_token"), ("grpc", "inter_token_latency"),
                ("POST", "http generate")]:
        assert key in stats, sorted(stats)
        assert int(stats[key]["Request Count"]) > 0 and int(stats[key]["Failure Count"]) == 0, stats[key]
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0


def test_bench_without_streaming_gets_one_response_per_request(server, tmp_path):
    for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
        out = tmp_path / f"{protocol}.json"
        rc = bench.main(["--url", url, "--protocol", protocol, "--no-stream", "--metrics-url", server.metrics_url,
                         *SMALL, "--num-requests", "4", "--concurrency", "2", "--output-json", str(out)])
        assert rc == 0
        (r,) = json.loads(out.read_text())["results"]
        assert r["target"] == f"server-{protocol}-nostream"
        _check(r, 4)
        assert r["itl_p50_s"] is None  # one response: no inter-token gaps
