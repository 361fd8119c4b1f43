"""LoRA adapters at run time, the doors without a server (issue 43 item 5): the Triton model's
control requests (`lora_action`, model_repository/llm/1/lora_control.py) on the Frontend with the
real engine, and the OpenAI server's /v1/load_lora_adapter and /v1/unload_lora_adapter
(openai_server/lora_api.py): off unless enabled (vLLM's 404), 400 / 404 naming why, 401 without
the key, /v1/models as the engine holds them. The engine's drain: test_lora_runtime.py; the real
tritonserver: e2e/test_lora_runtime.py."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from adapter_module import load_adapter
from backend.core.config import EngineConfig
from backend.engine.async_engine import AsyncEngine
from backend.models.make_model import make_model
from lora_adapters import make_adapter
from openai_server.lora_api import runtime_lora_enabled
from openai_server.triton_backend import error_status
from openai_server.translate import APIError

adapter = load_adapter()


class Sender:
    def __init__(self):
        self.responses, self.finished = [], threading.Event()

    def is_cancelled(self):
        return False


def respond(sender, tensors, error, final):
    sender.responses.append((tensors, error))
    if final:
        sender.finished.set()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-doors")
    base = make_model(root / "base")
    return base, {"a": make_adapter(base, root / "a", seed=31)}


def frontend_for(base, runtime):
    engine = AsyncEngine(EngineConfig(model_path=str(base), enable_lora=True, enable_runtime_lora=runtime,
                                      kv_block_size=16))
    return adapter.Frontend(engine, respond, poll_interval=0.01, runtime_lora=runtime)


def control(fe, timeout=60, **parameters):
    sender = Sender()
    fe.submit("", {name: None for name in adapter.INPUT_NAMES}, sender, json.dumps(parameters))
    assert sender.finished.wait(timeout)
    (tensors, error), = sender.responses
    if error is not None:
        return None, error
    return json.loads(tensors["text_output"][0]), None


def test_the_triton_door_loads_lists_and_unloads_after_the_running_request(tiny):
    base, adapters = tiny
    fe = frontend_for(base, runtime=True)
    try:
        assert control(fe, lora_action="list") == ({"message": "", "lora_name": None, "adapters": []}, None)
        answer, _ = control(fe, lora_action="load", lora_name="a", lora_path=str(adapters["a"]))
        assert answer == {"message": "Success: LoRA adapter 'a' added successfully.", "lora_name": "a", "adapters": ["a"]}
        _, error = control(fe, lora_action="load", lora_name="a", lora_path=str(adapters["a"]))
        assert error.code == "ALREADY_EXISTS" and "LoRA adapter 'a' is already loaded; unload it first" in error
        # a generation naming the loaded adapter through this door's usual key, then the unload
        running = Sender()
        fe.submit("", {"text_input": np.array([b"Once upon a time"], dtype=np.object_),
                       "return_num_output_tokens": np.array([True])}, running,
                  json.dumps({"lora_name": "a", "max_tokens": 40, "ignore_eos": True}))
        unload = Sender()
        fe.submit("", {}, unload, json.dumps({"lora_action": "unload", "lora_name": "a"}))
        assert not unload.finished.wait(0.05)  # it waits for the request holding the adapter
        assert running.finished.wait(60) and unload.finished.wait(60)
        # the adapter left once the request was done in the engine (its answer may still be on its way)
        assert not running.responses[-1][1] and running.responses[-1][0]["num_output_tokens"][0] == 40
        assert fe.engine.engine.loras.names() == []
        answer = json.loads(unload.responses[0][0]["text_output"][0])
        assert answer["message"] == "Success: LoRA adapter 'a' removed successfully." and answer["adapters"] == []
        _, error = control(fe, lora_action="unload", lora_name="a")
        assert error.code == "NOT_FOUND" and "LoRA adapter 'a' is not loaded" in error
        for bad, message in (({"lora_action": "drop"}, "lora_action must be one of list, load, unload; got 'drop'"),
                             ({"lora_action": "load", "lora_name": "x"}, "needs both lora_name and lora_path"),
                             ({"lora_action": "unload", "lora_name": "x", "lora_path": "/p"}, "unknown key(s) lora_path"),
                             ({"lora_action": "unload", "lora_int_id": 3}, "send its lora_name")):
            _, error = control(fe, **bad)
            assert message in error, error
    finally:
        fe.close(timeout=5)


def test_a_model_without_runtime_lora_lists_but_refuses_loads_saying_how(tiny):
    base, adapters = tiny
    fe = frontend_for(base, runtime=False)
    try:
        assert control(fe, lora_action="list")[0]["adapters"] == []
        for body in ({"lora_path": str(adapters["a"])}, {}):
            _, error = control(fe, lora_action="load" if body else "unload", lora_name="a", **body)
            assert error.code == "INVALID_ARG" and "enable_runtime_lora=true" in error
    finally:
        fe.close(timeout=5)


# -- the OpenAI server ---------------------------------------------------------------------------

class FakeTriton:
    """TritonBackend's LoRA part, answering as the model's lora_control does."""

    def __init__(self, url, model="llm"):
        self.model, self.loaded, self.calls = model, [], []

    async def lora_adapters(self, refresh=False):
        return dict.fromkeys(self.loaded, "")

    async def lora_control(self, parameters):
        self.calls.append(parameters)
        name = parameters.get("lora_name")
        if parameters["lora_action"] == "load":
            if parameters["lora_path"] == "/bad":
                message = f"LoRA adapter '{name}' (/bad): module 'layers.0.self_attn.o_proj' has rank 32, above max_lora_rank=16"
                raise APIError(error_status(message), message)
            self.loaded.append(name)
            return {"message": f"Success: LoRA adapter '{name}' added successfully."}
        if name not in self.loaded:
            message = f"LoRA adapter '{name}' is not loaded; loaded adapters: none"
            raise APIError(error_status(message), message)
        self.loaded.remove(name)
        return {"message": f"Success: LoRA adapter '{name}' removed successfully."}

    async def close(self):
        pass


def client(monkeypatch, **kw):
    import openai_server.app as app_module
    monkeypatch.setattr(app_module, "TritonBackend", FakeTriton)
    app = app_module.create_app("localhost:1", **kw)
    return TestClient(app), app.state.triton


def test_the_routes_are_off_by_default_as_vllm_answers_and_on_with_the_flag_or_vllms_variable(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    http, _ = client(monkeypatch)
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = http.post(route, json={"lora_name": "a", "lora_path": "/p"})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    assert runtime_lora_enabled(True, {}) and not runtime_lora_enabled(False, {})
    for value, on in (("true", True), ("1", True), ("True", True), ("false", False), ("0", False), ("", False)):
        assert runtime_lora_enabled(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is on
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    http, _ = client(monkeypatch)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"}).status_code == 200


def test_load_and_unload_answer_as_vllm_and_refusals_name_why(monkeypatch):
    http, triton = client(monkeypatch, runtime_lora=True, served_model_name="base")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/adapters/sql"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["base", "sql"]
    for body, field in (({"lora_name": "x"}, "lora_path"), ({"lora_path": "/p"}, "lora_name"), ({}, "lora_name")):
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        assert "needs both lora_name and lora_path" in r.json()["error"]["message"]
    for name in ("base", "llm"):  # the OpenAI server's base model name, and the Triton model's
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/p"})
        assert r.status_code == 400 and "is named like the served model" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": "/bad"})
    assert r.status_code == 400 and "has rank 32, above max_lora_rank=16" in r.json()["error"]["message"]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql", "lora_int_id": 1})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["base"]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert http.post("/v1/unload_lora_adapter", json={}).status_code == 400
    assert http.post("/v1/unload_lora_adapter", json={"lora_int_id": "one"}).status_code == 400
    assert triton.calls[-1] == {"lora_action": "unload", "lora_name": "sql"}


def test_the_routes_want_the_api_key(monkeypatch):
    http, triton = client(monkeypatch, runtime_lora=True, api_keys=("secret",))
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = http.post(route, json={"lora_name": "a", "lora_path": "/p"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert triton.calls == []
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"},
                  headers={"Authorization": "Bearer secret"})
    assert r.status_code == 200


def test_an_adapter_that_is_not_loaded_is_a_404_whichever_call_finds_out():
    assert error_status("LoRA adapter 'a' is not loaded (it is being unloaded); loaded adapters: none") == 404
    assert error_status("LoRA adapter 'a' is already loaded; unload it first") == 400


def test_inflight_serve_forwards_the_switch_to_the_openai_server():
    from client.cli import build_parser
    from client.serve import openai_flags
    from openai_server.__main__ import build_parser as openai_parser

    flags = openai_flags(build_parser().parse_args(["serve", "--enable-runtime-lora"]))
    assert "--enable-runtime-lora" in flags
    assert openai_parser().parse_args(list(flags)).enable_runtime_lora
    assert "--enable-runtime-lora" not in openai_flags(build_parser().parse_args(["serve"]))
