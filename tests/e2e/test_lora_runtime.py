"""LoRA adapters loaded and unloaded at run time on a real tritonserver and OpenAI port (issue 43
item 5): vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter behind --api-key, the adapter a
`model` on the OpenAI door and a `lora_name` on Triton's; an unload while requests of it and of
the base model run: none is lost (each answer equals the in-process engine's with the same
adapter, and that engine equals the PEFT-merged oracle: tests/test_lora_runtime.py), new requests
naming it are a 404 from the start of the unload, /v1/models follows; bad adapters refused naming
why. The unit tests of the doors: tests/test_lora_runtime_doors.py."""
from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest

from serving.openai_launcher import OpenAIServer

from .conftest import cpu_repository, requires_tritonserver, wait_until
from .raw_requests import array, grpc_stream

pytestmark = requires_tritonserver
openai = pytest.importorskip("openai")

KEY = "runtime-lora-key"
# LONG: requests that run for ~1.5 s on an idle 2-core machine, so the two of sql overlap even when a
# loaded host (CI) staggers their arrival by a fraction of that; the gauge that shows it is sampled
# every stats_interval (0.1 s) and reaches the metrics port some tens of ms later.
LONG, SHORT = 400, 12
PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_path):
    from lora_adapters import AdapterSpec, make_adapter

    root = tmp_path_factory.mktemp("lora-runtime-e2e")
    made = {"sql": make_adapter(model_path, root / "sql", seed=41),
            "poet": make_adapter(model_path, root / "poet", seed=42, spec=AdapterSpec(r=4, targets=("v_proj", "up_proj"))),
            "big": make_adapter(model_path, root / "big", seed=43, spec=AdapterSpec(r=32, targets=("o_proj",)))}
    pickled = root / "pickled"
    pickled.mkdir()
    shutil.copy(made["sql"] / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    made["pickled"] = pickled
    return made


@pytest.fixture(scope="module")
def stack(adapters, model_path, tmp_path_factory):
    from serving.triton_launcher import TritonServer

    repo = tmp_path_factory.mktemp("lora-runtime-repo")
    cpu_repository(repo)
    params = {"enable_lora": "true", "enable_runtime_lora": "true", "max_loras": "1", "max_cpu_loras": "2",
              "max_model_len": "512"}
    with TritonServer(repo, params=params, model_path=str(model_path)) as triton:
        with OpenAIServer(triton.grpc_url, model_path, extra_args=("--enable-runtime-lora",),
                          api_keys=(KEY,)) as api_server:
            yield triton, api_server


@pytest.fixture(autouse=True)
def no_adapter_left(stack):
    """Each test starts with no adapter loaded: one that failed midway does not fail the next."""
    yield
    _, api_server = stack
    for name in models(openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=KEY, max_retries=0))[1:]:
        post(api_server, "/v1/unload_lora_adapter", {"lora_name": name})


@pytest.fixture(scope="module")
def reference(adapters, model_path):
    from backend import LLM, SamplingParams

    llm = LLM(str(model_path), enable_lora=True, max_loras=2, max_model_len=512,
              lora_modules=f"sql={adapters['sql']},poet={adapters['poet']}")

    def greedy(prompt, adapter, max_tokens):
        return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                            lora_request=adapter)[0].text
    return greedy


def post(api_server, route, body, key=KEY):
    """(status, text) of a POST with the key (None: without)."""
    request = urllib.request.Request(f"{api_server.url}{route}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json",
                                      **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def models(api):
    return [m.id for m in api.models.list().data]


def complete(api, model, prompt, max_tokens):
    return api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text


def test_load_and_unload_while_requests_run_nothing_lost(stack, adapters, reference):
    triton, api_server = stack
    api = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    assert post(api_server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])},
                key=None)[0] == 401
    assert models(api) == ["llm"]
    assert post(api_server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])}) == \
        (200, "Success: LoRA adapter 'sql' added successfully.")
    assert models(api) == ["llm", "sql"]
    # the adapter is a lora_name on Triton's own door too: the same engine
    inputs = {"text_input": array(PROMPTS[1]), "stream": array(False), "exclude_input_in_output": array(True)}
    got = grpc_stream(triton.grpc_url, inputs, parameters={"temperature": "0", "max_tokens": str(SHORT),
                                                           "ignore_eos": "true", "lora_name": "sql"})
    assert got[0]["text_output"][0].decode() == reference(PROMPTS[1], "sql", SHORT)

    # long requests of sql and of the base model run while sql is unloaded
    answers, errors = {}, []

    def run(key, model, prompt):
        try:
            answers[key] = complete(api, model, prompt, LONG)
        except Exception as exc:  # reported below
            errors.append((key, exc))
    runs = [threading.Thread(target=run, args=(i, m, p)) for i, (m, p) in
            enumerate([("sql", PROMPTS[0]), ("llm", PROMPTS[1]), ("sql", PROMPTS[2])])]
    for t in runs:
        t.start()
    seen = []  # (seconds since the start, sql's running gauge): what the failure below reports
    start = time.monotonic()
    try:
        wait_until(lambda: seen.append((round(time.monotonic() - start, 3), gauge_running(triton, "sql")))
                   or seen[-1][1] == 2, timeout=60, interval=0.02)
    except AssertionError:
        raise AssertionError(f"sql's two requests never seen running together: gauge {seen[:8]} ... {seen[-4:]}; "
                             f"answered {sorted(answers)}; errors {errors}") from None
    unload = {}
    unloading = threading.Thread(target=lambda: unload.update(
        answer=post(api_server, "/v1/unload_lora_adapter", {"lora_name": "sql"})))
    unloading.start()
    wait_until(lambda: models(api) == ["llm"], timeout=30, interval=0.02)  # the drain has begun
    with pytest.raises(openai.NotFoundError, match="'sql'"):  # 404, whichever check finds it first
        complete(api, "sql", PROMPTS[0], 2)
    assert unloading.is_alive() or all(not t.is_alive() for t in runs)  # it waits for sql's requests
    for t in runs + [unloading]:
        t.join(300)
    assert errors == []
    assert unload["answer"] == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert answers == {0: reference(PROMPTS[0], "sql", LONG), 1: reference(PROMPTS[1], None, LONG),
                       2: reference(PROMPTS[2], "sql", LONG)}
    assert models(api) == ["llm"]
    with pytest.raises(RuntimeError, match="LoRA adapter 'sql' is not loaded; loaded adapters: none"):
        grpc_stream(triton.grpc_url, inputs, parameters={"max_tokens": "2", "lora_name": "sql"})
    assert post(api_server, "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 404
    wait_until(lambda: (counter(triton, "inflight_lora_loads_total"), counter(triton, "inflight_lora_unloads_total"))
               == (1.0, 1.0), timeout=10, interval=0.05)


def test_bad_adapters_are_refused_naming_why_and_the_triton_door_loads_too(stack, adapters, reference):
    triton, api_server = stack
    api = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    for body, reason in (({"lora_name": "big", "lora_path": str(adapters["big"])}, "has rank 32, above max_lora_rank=16"),
                         ({"lora_name": "gone", "lora_path": "/nowhere/at/all"}, "no adapter folder there"),
                         ({"lora_name": "pk", "lora_path": str(adapters["pickled"])}, "is a pickle and is never loaded"),
                         ({"lora_name": "llm", "lora_path": str(adapters["sql"])}, "named like the served model"),
                         ({"lora_name": "x"}, "needs both lora_name and lora_path")):
        status, text = post(api_server, "/v1/load_lora_adapter", body)
        assert status == 400 and reason in json.loads(text)["error"]["message"], (body, text)
    # Triton's door: a control request (no inputs), the adapter then a model on the OpenAI door
    answer = grpc_stream(triton.grpc_url, {}, parameters={"lora_action": "load", "lora_name": "poet",
                                                          "lora_path": str(adapters["poet"])})
    assert json.loads(answer[0]["text_output"][0])["adapters"] == ["poet"]
    assert complete(api, "poet", PROMPTS[2], SHORT) == reference(PROMPTS[2], "poet", SHORT)
    status, text = post(api_server, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(adapters["poet"])})
    assert status == 400 and "'poet' is already loaded" in text
    assert post(api_server, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])})[0] == 200
    status, text = post(api_server, "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": str(adapters["sql"])})
    assert status == 400 and "max_cpu_loras allows (2)" in text
    for name in ("poet", "sql"):
        assert post(api_server, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
    assert models(api) == ["llm"]


def gauge_running(triton, adapter):
    text = urllib.request.urlopen(triton.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("inflight_lora_requests{") and f'adapter="{adapter}"' in line and 'state="running"' in line:
            return float(line.rpartition(" ")[2])
    return None


def counter(triton, name):
    text = urllib.request.urlopen(triton.metrics_url, timeout=10).read().decode()
    return next((float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name + "{")), None)
