"""The README's `inflight bench --goodput` and `make load-slo` against the real local tritonserver
(the session's server from conftest.py), each bounded to a few seconds: a goodput search whose rates
all meet a loose SLO, one whose rates all miss a tight one, the OpenAI port as a target, and the SLO
Locust run passing and failing (its exit code). The search logic itself: tests/test_goodput.py."""
import json
import re
import shlex
import subprocess

from client.tools.benchmarks import bench
from .conftest import REPO_ROOT, requires_tritonserver

pytestmark = requires_tritonserver

# Bounded: 24-token prompts, 8 tokens out, about a second of arrivals per rate.
SHORT = ["--workload", "fixed", "--fixed-prompt-len", "24", "--fixed-output-len", "8", "--duration", "1",
         "--min-requests", "3", "--warmup", "1", "--no-progress"]


def readme_command(prefix: str) -> list[str]:
    """The README's command line that starts with `prefix`, as arguments."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    (line,) = [m.group(0) for m in re.finditer(rf"^{re.escape(prefix)}.*$", text, re.M)]
    return shlex.split(line.split("#")[0])


def goodput(server, tmp_path, name: str, *extra: str, url=None) -> tuple[int, dict]:
    # the README's command; later flags win (argparse), so the test only bounds it and points it here
    args = readme_command("inflight bench --goodput")[2:]
    out = tmp_path / f"{name}.json"
    rc = bench.main([*args, "--url", url or server.grpc_url, "--metrics-url", server.metrics_url, *SHORT,
                     *extra, "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_a_loose_slo_is_met_at_every_rate_and_sizes_the_target(server, tmp_path, capsys):
    rc, data = goodput(server, tmp_path, "loose", "--rate", "2", "--max-runs", "2",
                       "--slo-ttft-p99", "30", "--slo-itl-p99", "10", "--target-rpm", "2000")
    assert rc == 0
    assert [(r["rate"], r["meets_slo"]) for r in data["runs"]] == [(2.0, True), (4.0, True)]
    for r in data["runs"]:
        assert r["failed"] == 0 and r["completed"] == r["num_requests"] >= 3
        assert 0 < r["ttft_p99_s"] < 30 and 0 < r["itl_p99_s"] < 10
    assert data["goodput_rps"] == 4.0 and data["lowest_missed_rps"] is None
    assert data["instances_needed"] == 9  # ceil(2000 / 240)
    assert data["meta"]["target"] == "server-grpc" and data["meta"]["mode"] == "inflight"
    printed = capsys.readouterr().out
    assert "instances needed for 2000 requests/min: 9" in printed and "a lower bound" in printed


def test_a_slo_no_rate_meets_halves_the_rate_and_exits_1(server, tmp_path, capsys):
    rc, data = goodput(server, tmp_path, "tight", "--rate", "4", "--min-rate", "2", "--max-runs", "3",
                       "--slo-ttft-p99", "0.0001", "--slo-itl-p99", "10")
    assert rc == 1
    assert [(r["rate"], r["meets_slo"]) for r in data["runs"]] == [(4.0, False), (2.0, False)]
    assert all(m.startswith("TTFT p99") for r in data["runs"] for m in r["misses"])
    assert data["goodput_rps"] is None and data["instances_needed"] is None
    assert "no rate met the SLO" in capsys.readouterr().out


def test_the_openai_port_is_a_target(server, model_path, tmp_path):
    from serving.openai_launcher import OpenAIServer

    with OpenAIServer(server.grpc_url, model_path) as api:  # as `inflight serve` starts it
        rc, data = goodput(server, tmp_path, "openai", "--protocol", "openai", "--rate", "2", "--max-runs", "1",
                           "--slo-ttft-p99", "30", "--slo-itl-p99", "10", url=f"127.0.0.1:{api.port}")
    assert rc == 0, data["runs"][0]["errors"]
    (run,) = data["runs"]
    # from the final usage: one of these streams has an event with no text, its token sent with the next
    assert run["failed"] == 0 and run["output_tokens"] == 8 * run["completed"]
    assert run["itl_p99_s"] is not None and data["meta"]["target"] == "server-openai"


def load_slo(server, **make_vars) -> subprocess.CompletedProcess:
    """`make load-slo` as the Makefile spells it (make -n prints the recipe), pointed at this server."""
    assert "make load-slo" in (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assigns = [f"{k}={v}" for k, v in {"LOAD_HOST": f"http://{server.http_url}", **make_vars}.items()]
    recipe = subprocess.run(["make", "-n", "-s", "load-slo", *assigns], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout.replace("\\\n", " ")
    (line,) = [x for x in recipe.splitlines() if "slo_locustfile.py" in x]
    env = {"INFLIGHT_GRPC_URL": server.grpc_url, "INFLIGHT_WORKLOAD": "fixed", "INFLIGHT_MAX_TOKENS": "8",
           "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(["env", *(f"{k}={v}" for k, v in env.items()), *shlex.split(line), "--loglevel", "WARNING"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)


def test_the_slo_locust_run_passes_a_loose_slo_and_fails_a_tight_one(server):
    ok = load_slo(server, LOAD_TIME="4s", LOAD_RATE="4", LOAD_SLO_TTFT_P99="30", LOAD_SLO_ITL_P99="10")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    report = ok.stderr[ok.stderr.index("SLO run:"):]
    sent = int(re.search(r"(\d+) requests, (\d+) completed, 0 failed", report).group(1))
    assert 6 <= sent <= 40 and "SLO met" in report  # Poisson at 4/s for 4 s
    assert re.search(r"TTFT p50 [\d.]+ ms, p99 [\d.]+ ms", report) and "inter-token p50" in report

    missed = load_slo(server, LOAD_TIME="2s", LOAD_RATE="4", LOAD_ARRIVALS="constant", LOAD_SLO_TTFT_P99="0.0001")
    assert missed.returncode == 1, missed.stdout[-3000:] + missed.stderr[-3000:]
    assert "SLO missed: TTFT p99" in missed.stderr and "constant arrivals at 4.0/s" in missed.stderr
