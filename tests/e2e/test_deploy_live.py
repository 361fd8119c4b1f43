"""The deployment files against a live server: every metric the Grafana dashboard queries exists on
/metrics, and the health check (Docker HEALTHCHECK, Kubernetes liveness) passes on a working server
and fails where no engine answers."""
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from client.grpc_client import GrpcClient

from .conftest import requires_tritonserver, wait_until
from .series import names

pytestmark = requires_tritonserver

ROOT = Path(__file__).resolve().parents[2]
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"


def dashboard_metric_names() -> set[str]:
    """Every inflight_* name in the dashboard's PromQL (tests/test_deploy.py checks the queries)."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "inflight.json").read_text())
    return {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\b(inflight_[a-z0-9_]+)", target["expr"])}


# Series made per LoRA adapter, so served only with enable_lora and an adapter loaded: the LoRA
# e2e test (tests/e2e/test_lora_serving.py) reads them from a server that has adapters.
PER_ADAPTER = {"inflight_lora_requests"}
# Series made per KV tier, so served only with kv_host_cache_bytes: the tiers' served test
# (tests/e2e/test_kv_tiers_served.py) reads the dashboard's from a server with tiers.
PER_TIER_PREFIX = "inflight_kv_tier_"


def test_every_metric_the_dashboard_queries_is_served(server):
    with GrpcClient(server.grpc_url) as client:
        client.generate("dashboard", stream=True, max_tokens=4)
    served = wait_until(lambda: (lambda names: names if "inflight_e2e_request_latency_seconds_bucket" in names
                                 else None)(names(server)))
    queried = {n for n in dashboard_metric_names() - PER_ADAPTER if not n.startswith(PER_TIER_PREFIX)}
    assert queried and queried <= served, sorted(queried - served)


def run_healthcheck(url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), "--url", url, "--timeout", "30"],
                          capture_output=True, text=True, timeout=60)


def test_healthcheck_passes_on_a_live_server(server):
    proc = run_healthcheck(f"http://{server.http_url}")
    assert proc.returncode == 0, proc.stderr


def test_healthcheck_fails_where_nothing_answers():
    from serving.triton_launcher import free_port

    proc = run_healthcheck(f"http://127.0.0.1:{free_port()}")
    assert proc.returncode == 1 and "inflight healthcheck:" in proc.stderr


def test_healthcheck_fails_when_the_stub_is_dead_though_triton_reads_ready(model_repository, model_path):
    """Why liveness is a generate and not /v2/health/ready: kill -9 of the Python stub leaves
    Triton 2.51 reporting ready, and only a request through the engine shows the server is dead."""
    import os
    import signal

    from serving.triton_launcher import TritonServer
    from client.tools.load.soak import server_processes

    with TritonServer(model_repository, params={"max_model_len": "512"}, model_path=str(model_path),
                      exit_timeout=2) as server:
        assert run_healthcheck(f"http://{server.http_url}").returncode == 0
        _, stubs = server_processes(server.process.pid)
        stubs = [p for p in stubs if "/llm/1/" in " ".join(p.cmdline())]   # llm's, not llm_trtllm's
        assert len(stubs) == 1
        os.kill(stubs[0].pid, signal.SIGKILL)
        wait_until(lambda: not stubs[0].is_running() or stubs[0].status() == "zombie", timeout=10)
        ready = urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=10).status
        assert ready == 200                                   # the readiness probe stays green...
        proc = run_healthcheck(f"http://{server.http_url}")
        assert proc.returncode == 1 and "not healthy" in proc.stderr, proc.stderr   # ...liveness does not
