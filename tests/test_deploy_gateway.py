"""deploy/kubernetes/gateway/ (inflight behind the inference gateway) and
deploy/kubernetes/leaderworkerset/ (a tensor-parallel group as a LeaderWorkerSet), checked offline:
the custom resources against the CRDs' published schemas (tests/data/crds/, strict: an unknown field
fails, as the API server's strict field validation does), the core kinds with kubernetes-validate,
and the pieces fitting together: the pool selects the model-server pods and routes to their OpenAI
port, the endpoint picker's configuration names metrics inflight serves and the plugins its image
has, the pods' KV-event ports and topic are the ones the picker subscribes to, the group's size is
its tensor_parallel_size. CEL rules (x-kubernetes-validations) are not evaluated; the pool's two are
checked by hand below."""
from __future__ import annotations

import copy
import gzip
import hashlib
import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from test_deploy import KUBE_VERSION

ROOT = Path(__file__).resolve().parents[1]
GATEWAY = ROOT / "deploy" / "kubernetes" / "gateway"
LWS = ROOT / "deploy" / "kubernetes" / "leaderworkerset"
CRDS = ROOT / "tests" / "data" / "crds"
CRD_FILES = {("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
             ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml.gz",
             ("gateway.networking.k8s.io/v1", "Gateway"): "gateway.networking.k8s.io_gateways.yaml.gz",
             ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz"}
# The plugin types registered in the endpoint picker image epp.yaml runs (llm-d-router v0.9.0,
# pkg/epp/framework/plugins): a misspelt type would stop the picker at start.
EPP_PLUGIN_TYPES = {"metrics-data-source", "core-metrics-extractor", "endpoint-notification-source", "queue-scorer",
                    "kv-cache-utilization-scorer", "prefix-cache-scorer", "lora-affinity-scorer", "max-score-picker",
                    "single-profile-handler", "token-producer", "precise-prefix-cache-producer",
                    "approx-prefix-cache-producer", "load-aware-scorer", "active-request-scorer", "no-hit-lru-scorer"}


def documents(folder: Path) -> list[dict]:
    listed = yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]
    assert set(listed) == {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    return [doc for name in listed for doc in yaml.safe_load_all((folder / name).read_text())]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return found


ALL = documents(GATEWAY) + documents(LWS)


# -- schemas ---------------------------------------------------------------------------------------

def strict(schema: dict) -> dict:
    """A CRD's structural OpenAPI v3 schema as JSON Schema: objects with properties take no others
    (unless x-kubernetes-preserve-unknown-fields), int-or-string and nullable as Kubernetes reads them."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    for key in ("properties", "patternProperties"):
        if key in out:
            out[key] = {name: strict(sub) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_text(name: str) -> str:
    data = (CRDS / name).read_bytes()
    return (gzip.decompress(data) if name.endswith(".gz") else data).decode()


_VALIDATORS: dict = {}


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    if (api_version, kind) not in _VALIDATORS:
        crd = yaml.load(crd_text(CRD_FILES[(api_version, kind)]), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        version = api_version.split("/")[1]
        assert crd["spec"]["group"] == api_version.split("/")[0] and crd["spec"]["names"]["kind"] == kind
        (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
        _VALIDATORS[(api_version, kind)] = jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))
    return _VALIDATORS[(api_version, kind)]


def validate_custom(doc: dict) -> None:
    crd_validator(doc["apiVersion"], doc["kind"]).validate(doc)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])


CUSTOM = [d for d in ALL if (d["apiVersion"], d["kind"]) in CRD_FILES]
CORE = [d for d in ALL if (d["apiVersion"], d["kind"]) not in CRD_FILES]


@pytest.mark.parametrize("doc", CUSTOM, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_custom_resource_matches_its_crds_published_schema(doc):
    validate_custom(doc)


@pytest.mark.parametrize("doc", CORE, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_core_document_matches_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("role", ["leaderTemplate", "workerTemplate"])
def test_the_groups_pod_templates_match_the_kubernetes_schema(role):
    template = one(ALL, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"][role]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                  "template": template}, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("kind, path, bad", [
    ("InferencePool", ("spec", "targetPorts", 0), {"numbr": 9000}),                 # misspelt field
    ("InferencePool", ("spec", "endpointPickerRef", "failureMode"), "FailSometimes"),  # not in the enum
    ("HTTPRoute", ("spec", "rules", 0, "backendRefs", 0, "weight"), "heavy"),       # wrong type
    ("Gateway", ("spec", "listeners", 0, "protocol"), None),                        # wrong type
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "sizee"), 2),               # unknown field
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "imagePullPolicyy"),
     "Always"),                                                                        # inside the pod spec
])
def test_the_crd_validation_rejects_bad_documents(kind, path, bad):
    doc = copy.deepcopy(one(CUSTOM, kind))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(doc)


def test_the_crds_are_the_published_files_with_their_licence():
    readme = (CRDS / "README.md").read_text()
    for name in CRD_FILES.values():
        digest = hashlib.sha256(crd_text(name).encode()).hexdigest()
        assert f"`{name}`" in readme and digest in readme, name
    assert "Apache License" in (CRDS / "LICENSE").read_text() and "Apache-2.0" in readme


# -- the gateway's pieces fit together -------------------------------------------------------------

GW = documents(GATEWAY)
POOL, ROUTE = one(GW, "InferencePool"), one(GW, "HTTPRoute")
SERVERS = one(GW, "Deployment", "inflight-pool")
EPP = one(GW, "Deployment", "inflight-epp")
POD = SERVERS["spec"]["template"]
CONTAINER = POD["spec"]["containers"][0]
PORTS = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}
ENV = {e["name"]: e.get("value") for e in CONTAINER["env"]}


def epp_configs() -> dict[str, dict]:
    return {name: yaml.safe_load(text) for name, text in one(GW, "ConfigMap", "inflight-epp")["data"].items()}


def test_the_pool_selects_the_model_servers_and_routes_to_their_openai_port():
    selector = POOL["spec"]["selector"]["matchLabels"]
    assert all(POD["metadata"]["labels"].get(k) == v for k, v in selector.items())
    assert SERVERS["spec"]["selector"]["matchLabels"] == selector
    assert [p["number"] for p in POOL["spec"]["targetPorts"]] == [PORTS["openai"]] == [9000]
    # the CRD's CEL rules, by hand: unique target ports; a port on a Service picker reference
    numbers = [p["number"] for p in POOL["spec"]["targetPorts"]]
    assert len(set(numbers)) == len(numbers)
    ref = POOL["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and "port" in ref
    service = one(GW, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert all(EPP["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in service["spec"]["selector"].items())
    args = EPP["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == POOL["metadata"]["name"]
    assert args[args.index("--pool-group") + 1] == POOL["apiVersion"].split("/")[0]
    assert not any(a.startswith(("--total-queued", "--kv-cache-usage", "--lora-info", "--cache-info")) for a in args)
    (backend,) = ROUTE["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                                     POOL["metadata"]["name"])
    assert ROUTE["spec"]["parentRefs"][0]["name"] == one(GW, "Gateway")["metadata"]["name"]
    assert POD["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] == "openai"


def test_the_pickers_configuration_names_metrics_inflight_serves():
    from openai_server.metrics import PodFigures, parse_exposition, render

    figures = PodFigures(1, 0, 0, 0, 1, block_size="16", lora={"max_lora": 1, "running": [], "waiting": [], "updated": 0},
                         blocks={"used": 0, "free": 1, "total": 1, "num_gpu_blocks": 1})
    served = {s.name for s in parse_exposition(render(figures, "llm"))}
    args = EPP["spec"]["template"]["spec"]["containers"][0]["args"]
    configs = epp_configs()
    assert Path(args[args.index("--config-file") + 1]).name in configs
    mount = EPP["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert args[args.index("--config-file") + 1].startswith(mount["mountPath"] + "/")
    for name, config in configs.items():
        assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig"), name
        types = {p["type"] for p in config["plugins"]}
        assert types <= EPP_PLUGIN_TYPES, (name, types - EPP_PLUGIN_TYPES)
        declared = {p.get("name", p["type"]) for p in config["plugins"]}
        refs = {r["pluginRef"] for prof in config["schedulingProfiles"] for r in prof["plugins"]}
        refs |= {s["pluginRef"] for s in config.get("dataLayer", {}).get("sources", [])}
        refs |= {e["pluginRef"] for s in config.get("dataLayer", {}).get("sources", []) for e in s.get("extractors", [])}
        assert refs <= declared, (name, refs - declared)
        (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
        (engine,) = extractor["parameters"]["engineConfigs"]
        assert engine["name"] == POD["metadata"]["labels"]["llm-d.ai/engine-type"] == extractor["parameters"]["defaultEngine"]
        specs = [engine[k] for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")]
        assert set(specs) <= served, set(specs) - served
    # vLLM's names are served too: the picker's default `vllm` engine works without the label
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:lora_requests_info", "vllm:cache_config_info"} <= served


def test_the_pods_publish_kv_events_where_the_picker_subscribes():
    from backend.core.config import EngineConfig

    raw = ENV["INFLIGHT_KV_EVENTS_CONFIG"].replace("$(POD_IP)", "10.1.2.3")
    names = [e["name"] for e in CONTAINER["env"]]
    assert names.index("POD_IP") < names.index("INFLIGHT_KV_EVENTS_CONFIG")   # so Kubernetes expands $(POD_IP)
    params = dict(a.split("=", 1) for a in shlex.split(ENV["INFLIGHT_CONFIG_ARGS"]) if "=" in a)
    events = EngineConfig(kv_events_config=raw, enable_kv_cache_reuse=params["enable_kv_cache_reuse"] == "true").kv_events
    assert events.publishes and events.topic == f"kv@10.1.2.3:{PORTS['openai']}@llm"
    assert int(events.endpoint.rsplit(":", 1)[1]) == PORTS["kv-events"]
    assert int(events.replay_endpoint.rsplit(":", 1)[1]) == PORTS["kv-replay"]
    (producer,) = [p for p in epp_configs()["inflight-precise-prefix-plugins.yaml"]["plugins"]
                   if p["type"] == "precise-prefix-cache-producer"]
    kv = producer["parameters"]["kvEventsConfig"]
    assert events.topic.startswith(kv["topicFilter"]) and kv["discoverPods"] is True
    discovery = kv["podDiscoveryConfig"]
    assert (discovery["socketPort"], discovery["replaySocketPort"]) == (PORTS["kv-events"], PORTS["kv-replay"])
    key, value = discovery["podLabelSelector"].split("=")
    assert POD["metadata"]["labels"][key] == value
    assert producer["parameters"]["tokenProcessorConfig"]["blockSize"] == EngineConfig().kv_block_size


def test_the_entrypoint_passes_the_kv_events_config_as_one_parameter():
    script = (ROOT / "deploy" / "docker" / "entrypoint.sh").read_text()
    assert 'kv_events=(--param "kv_events_config=${INFLIGHT_KV_EVENTS_CONFIG}")' in script
    assert '"${kv_events[@]}"' in script and "--metrics-url http://127.0.0.1:8002/metrics" in script


# -- the LeaderWorkerSet ---------------------------------------------------------------------------

def test_the_leaderworkerset_group_fits_together():
    lws = one(ALL, "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    worker = group["workerTemplate"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in leader["env"]}
    args = shlex.split(env["INFLIGHT_CONFIG_ARGS"])
    params = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--param")
    assert int(params["tensor_parallel_size"]) == group["size"] == 2 and env["INFLIGHT_TP_LOCAL_RANKS"] == "1"
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert 'MASTER_ADDR="$LWS_LEADER_ADDRESS"' in leader["args"][0] and "inflight-entrypoint" in leader["args"][0]
    assert 'MASTER_ADDR="$LWS_LEADER_ADDRESS"' in worker["args"][0]
    assert 'backend.worker.parallel.worker --rank "$LWS_WORKER_INDEX"' in worker["args"][0]
    worker_env = {e["name"]: e.get("value") for e in worker["env"]}
    rendezvous = {p["name"]: p["containerPort"] for p in leader["ports"]}["rendezvous"]
    assert int(env["MASTER_PORT"]) == int(worker_env["MASTER_PORT"]) == rendezvous
    claims = {json.dumps(v["persistentVolumeClaim"]) for t in ("leaderTemplate", "workerTemplate")
              for v in group[t]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert len(claims) == 1                                                      # both ranks read one checkpoint
    mount = next(m for m in leader["volumeMounts"] if m["name"] == "checkpoint")
    assert params["model_path"].startswith(mount["mountPath"] + "/")
    service = one(ALL, "Service", "inflight-lws")
    assert service["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                                           **{"role": group["leaderTemplate"]["metadata"]["labels"]["role"]}}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in leader["ports"]}
    assert "/v2/models/llm/ready" == leader["readinessProbe"]["httpGet"]["path"]
