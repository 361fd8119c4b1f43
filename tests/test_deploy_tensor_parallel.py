"""deploy/kubernetes/tensor-parallel/: the two-pod tensor-parallel group, checked offline against
the Kubernetes API schemas kubernetes-validate bundles (strict: an unknown field fails), as
tests/test_deploy.py checks the single-pod manifests, and for the pieces fitting together (the
rendezvous address is pod 0's stable name, the group's size is the pod count, clients reach pod 0)."""
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from test_deploy import KUBE_VERSION

FOLDER = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "tensor-parallel"


def documents() -> list[dict]:
    listed = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())["resources"]
    assert set(listed) == {p.name for p in FOLDER.glob("*.yaml")} - {"kustomization.yaml"}
    return [doc for name in listed for doc in yaml.safe_load_all((FOLDER / name).read_text())]


def by_kind() -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for doc in documents():
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


@pytest.mark.parametrize("index", range(3))
def test_every_document_matches_the_kubernetes_schema(index):
    docs = documents()
    assert len(docs) == 3
    kubernetes_validate.validate(docs[index], KUBE_VERSION, strict=True)


def test_the_validator_rejects_a_misspelt_field_in_the_statefulset():
    (sts,) = by_kind()["StatefulSet"]
    sts["spec"]["servicename"] = sts["spec"].pop("serviceName")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBE_VERSION, strict=True)


def test_the_group_fits_together():
    kinds = by_kind()
    (sts,) = kinds["StatefulSet"]
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    config_args = shlex.split(env["INFLIGHT_CONFIG_ARGS"])
    params = dict(config_args[i + 1].split("=", 1) for i, a in enumerate(config_args) if a == "--param")
    assert int(params["tensor_parallel_size"]) == sts["spec"]["replicas"] == 2      # one rank per pod
    assert env["INFLIGHT_TP_LOCAL_RANKS"] == "1"                                   # rank 0 starts none itself
    name = sts["metadata"]["name"]
    assert env["MASTER_ADDR"] == f"{name}-0.{headless['metadata']['name']}"        # pod 0, by its stable name
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(env["MASTER_PORT"]) == ports["rendezvous"] == headless["spec"]["ports"][0]["port"]
    script = container["args"][0]
    assert "inflight-entrypoint" in script and "python3 -m backend.worker.parallel.worker --rank" in script
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    mount = next(m for m in container["volumeMounts"] if m["name"] == "checkpoint")
    assert params["model_path"].startswith(mount["mountPath"] + "/")               # both ranks read the same folder
    api = services[f"{name}-api"]
    assert api["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == f"{name}-0"
    assert {p["targetPort"] for p in api["spec"]["ports"]} <= set(ports)
    assert "/v2/models/llm/ready" in " ".join(container["readinessProbe"]["exec"]["command"])
