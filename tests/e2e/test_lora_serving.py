"""Multi-LoRA served by a real tritonserver: the tiny model with two adapters in its folder's
multi_lora.json (the vLLM backend's file) and a third from `lora_modules`, at most two resident.
The vLLM backend's request (samples/client_lora.py: lora_name in sampling_parameters), the request
parameters, the official openai SDK with `model` set to an adapter; unknown names; the
`inflight_lora_requests` gauge. Answers equal the in-process engine's with the same adapters (the
engine itself equals transformers with each adapter merged: tests/test_lora_engine.py)."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from serving.openai_launcher import OpenAIServer

from .conftest import cpu_repository, requires_tritonserver, wait_until
from .raw_requests import array, grpc_stream
from .test_vllm_backend_clients import PROMPTS, run_sample_client

pytestmark = requires_tritonserver
openai = pytest.importorskip("openai")

MAX_TOKENS = 12
PARAMS = {"enable_lora": "true", "max_loras": "2", "max_model_len": "512"}


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, model_path):
    from lora_adapters import AdapterSpec, checkpoint_with_adapters

    return checkpoint_with_adapters(model_path, tmp_path_factory.mktemp("lora-serving"), ("sql", "poet", "chef"),
                                    seed=21, spec=AdapterSpec(r=8, alpha=16), listed=("sql", "poet"))


@pytest.fixture(scope="module")
def lora_server(lora_setup, tmp_path_factory):
    from serving.triton_launcher import TritonServer

    folder, adapters = lora_setup
    repo = tmp_path_factory.mktemp("lora-repo")
    cpu_repository(repo)
    params = {**PARAMS, "lora_modules": f"chef={adapters['chef']}"}
    with TritonServer(repo, params=params, model_path=str(folder)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(lora_setup):
    from backend import LLM, SamplingParams

    folder, adapters = lora_setup
    llm = LLM(str(folder), enable_lora=True, max_loras=2, max_model_len=512, lora_modules=f"chef={adapters['chef']}")

    def greedy(prompt, adapter):
        return llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                            lora_request=adapter)[0].text
    return greedy


def test_the_vllm_backends_lora_request_answers_with_each_adapter_mixed_on_one_stream(lora_server, reference):
    """samples/client_lora.py's request (lora_name in sampling_parameters) over samples/client.py's
    stream: the four prompts at once, each with another adapter or none (three adapters, two
    slots: they share steps and one waits), rotated so every prompt meets every adapter."""
    names = ["sql", "poet", "chef", None]
    answers = {}
    for k in range(len(names)):
        chosen = [names[(i + k) % len(names)] for i in range(len(PROMPTS))]
        sampling = [{"temperature": "0", "max_tokens": str(MAX_TOKENS), "ignore_eos": "true",
                     **({"lora_name": adapter} if adapter else {})} for adapter in chosen]
        results, errors = asyncio.run(run_sample_client(lora_server.grpc_url, sampling, stream=True))
        assert errors == []
        for i, adapter in enumerate(chosen):
            answers[(i, adapter)] = b"".join(results[str(i)]).decode()
    for (i, adapter), text in answers.items():
        assert text == reference(PROMPTS[i], adapter), (i, adapter)
    for i in range(len(PROMPTS)):
        assert len({answers[(i, a)] for a in names}) == 4  # four different models


def test_lora_name_as_a_request_parameter_and_unknown_names_listing_the_loaded(lora_server, reference):
    inputs = {"text_input": array(PROMPTS[2]), "stream": array(False), "exclude_input_in_output": array(True)}
    responses = grpc_stream(lora_server.grpc_url, inputs, parameters={
        "temperature": "0", "max_tokens": str(MAX_TOKENS), "ignore_eos": "true", "lora_name": "chef"})
    assert responses[0]["text_output"][0].decode() == reference(PROMPTS[2], "chef")
    with pytest.raises(RuntimeError, match=r"LoRA adapter 'nope' is not loaded; loaded adapters: sql, poet, chef"):
        grpc_stream(lora_server.grpc_url, {**inputs, "sampling_parameters": array(json.dumps({"lora_name": "nope"}))})
    for bad in (3, ""):  # "" would otherwise run the base model without a word
        with pytest.raises(RuntimeError, match=f"lora_name must be a loaded adapter's name .*got {bad!r}"):
            grpc_stream(lora_server.grpc_url, {**inputs, "sampling_parameters": array(json.dumps({"lora_name": bad}))})


def lora_gauge(server, adapter, state):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("inflight_lora_requests{") and f'adapter="{adapter}"' in line and f'state="{state}"' in line:
            assert 'instance="' in line and 'device="cpu"' in line, line
            return float(line.rpartition(" ")[2])
    return None


def test_the_lora_gauge_counts_running_and_waiting_requests_per_adapter(lora_server):
    """Three long requests, one per adapter, with two slots: two run and the third waits, by name."""
    import threading

    done = []

    def send(adapter):
        inputs = {"text_input": array("Once upon a time"), "stream": array(False),
                  "sampling_parameters": array(json.dumps({"max_tokens": 400, "ignore_eos": True, "lora_name": adapter}))}
        done.append(grpc_stream(lora_server.grpc_url, inputs, timeout=300))

    threads = [threading.Thread(target=send, args=(a,)) for a in ("sql", "poet", "chef")]
    for t in threads:
        t.start()
    states = wait_until(lambda: (lambda s: s if sum(s.values()) == 3 and s["waiting"] == 1 else None)(
        {st: sum(lora_gauge(lora_server, a, st) or 0 for a in ("sql", "poet", "chef")) for st in ("running", "waiting")}),
        timeout=60, interval=0.05)
    assert states == {"running": 2, "waiting": 1}
    for t in threads:
        t.join(300)
    assert len(done) == 3
    wait_until(lambda: all(lora_gauge(lora_server, a, s) == 0 for a in ("sql", "poet", "chef")
                           for s in ("running", "waiting")), timeout=10)


def test_the_openai_sdk_with_model_set_to_an_adapter(lora_server, lora_setup, reference):
    folder, _ = lora_setup
    with OpenAIServer(lora_server.grpc_url, folder) as api_server:
        api = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        models = {m.id: m for m in api.models.list().data}
        assert list(models) == ["llm", "sql", "poet", "chef"]
        assert models["poet"].model_extra["parent"] == "llm"
        for adapter in ("poet", "chef", "llm"):
            out = api.completions.create(model=adapter, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
            assert out.model == adapter
            assert out.choices[0].text == reference(PROMPTS[0], None if adapter == "llm" else adapter)
        with pytest.raises(openai.NotFoundError, match="'sql', 'poet', 'chef'"):
            api.completions.create(model="nope", prompt="x", max_tokens=2)
