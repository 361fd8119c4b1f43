"""The OpenAI door against the audit's hostile inputs, in-process (FastAPI's TestClient, no Triton
behind it: each of these is answered before a request would reach Triton): a 400 naming the field
for nesting, lone surrogates, out-of-range numbers, schema keywords xgrammar cannot enforce, and
invalid or unsatisfiable tool schemas; /v1/models names models without the server's folders."""
from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from serving.triton_launcher import free_port
from openai_server.app import create_app

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
USER = [{"role": "user", "content": "hi"}]
TAGS = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


def tool(parameters, name="f", description="a function"):
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def nested_text(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_object(depth: int) -> dict:
    value: dict = {"type": "object"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


@pytest.fixture(scope="module")
def client(default_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("door-model") / "m"
    shutil.copytree(default_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    app = create_app(f"127.0.0.1:{free_port()}", str(path))  # nothing listens there: past the door is a 503
    app.state.triton._adapters = {"sql": str(tmp_path_factory.getbasetemp() / "secret" / "adapters" / "sql")}
    with TestClient(app) as c:
        yield c


def chat(**body):
    return {"model": "llm", "messages": USER, "max_tokens": 4, **body}


def completion(**body):
    return {"model": "llm", "prompt": "hi", "max_tokens": 4, **body}


CASES = {
    # nesting: the vLLM backend's JSON-string form of a schema, 50k levels deep
    "guided_json nested 50k": ("/v1/completions", completion(guided_json=nested_text(50_000)), "guided_json",
                               "nested too deeply"),
    "structured_outputs nested 100 objects": ("/v1/completions", completion(structured_outputs={"json": nested_object(100)}),
                                      "structured_outputs", "nested more than 128 levels"),
    # lone surrogates, which JSON escapes allow and UTF-8 cannot carry
    "surrogate in prompt": ("/v1/completions", completion(prompt="a\ud800b"), "prompt", "lone surrogate"),
    "surrogate in content": ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "\udfff"}]),
                             "messages", "messages[0].content is not valid Unicode"),
    "surrogate in model": ("/v1/chat/completions", chat(model="llm\ud800"), "model", "lone surrogate"),
    "surrogate in tool description": ("/v1/chat/completions", chat(tools=[tool({}, description="x\ud800")]),
                                      "tools", "tools[0].function.description is not valid Unicode"),
    "surrogate in stop": ("/v1/completions", completion(stop=["ok", "\ud801"]), "stop", "stop[1] is not valid"),
    # numbers past what their field can hold
    "temperature 1e400": ("/v1/completions", completion(temperature=json.loads("1e400")), "temperature",
                          "finite number"),
    "top_k 10^400": ("/v1/completions", completion(top_k=10 ** 400, temperature=json.loads("1e400")), "temperature",
                     "finite"),
    # schema keywords xgrammar would ignore: the "guaranteed" output could break them
    "uniqueItems": ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "t", "schema": TAGS}}), "response_format", "uniqueItems at /"),
    "not, if/then/else, dependentRequired, remote $ref": ("/v1/completions", completion(structured_outputs={"json": {
        "type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}},
                                         "b": {"$ref": "https://example.com/b.json"}},
        "if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {}, "dependentRequired": {"a": ["b"]}}}),
        "structured_outputs", "if at /, then at /, else at /, dependentRequired at /, not at /properties/a, "
                              "remote $ref 'https://example.com/b.json' at /properties/b"),
    # tools whose parameters no call could follow, whatever tool_choice says
    "invalid tool schema (auto)": ("/v1/chat/completions", chat(tools=[tool({"type": "objekt"})], tool_choice="auto"),
                                   "tools", "tools[0].function.parameters: /type must be one of"),
    "unsatisfiable tool schema (named)": ("/v1/chat/completions", chat(
        tools=[tool({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                     "required": ["n"]})], tool_choice={"type": "function", "function": {"name": "f"}}),
        "tools", "/properties/n can never be satisfied: minimum 5 and maximum 1 leave no number"),
    "unenforceable tool schema (required)": ("/v1/chat/completions", chat(
        tools=[tool({"type": "object", "properties": {"tags": TAGS}})], tool_choice="required"),
        "tools", "uniqueItems at /properties/tags"),
    "empty model (the lora_name of the OpenAI door)": ("/v1/completions", completion(model=""), "model",
                                                       "does not exist"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_hostile_input_is_a_4xx_naming_its_field(client, case):
    path, body, param, words = CASES[case]
    got = client.post(path, content=json.dumps(body))  # json.dumps keeps "\ud800" as an escape
    error = got.json()["error"]
    assert 400 <= got.status_code < 500 and error["param"] == param, (got.status_code, error)
    assert words in error["message"], error["message"]
    assert client.get("/v1/models").status_code == 200  # serving on


def test_strict_false_accepts_keywords_xgrammar_does_not_enforce(client):
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": TAGS, "strict": False}})
    assert client.post("/v1/chat/completions", json=body).status_code == 503  # past the door: Triton is not there
    loose_tool = tool({"type": "object", "properties": {"tags": TAGS}})
    loose_tool["function"]["strict"] = False
    body = chat(tools=[loose_tool], tool_choice="required")
    assert client.post("/v1/chat/completions", json=body).status_code == 503


def test_models_are_listed_by_name_without_the_servers_folders(client):
    got = client.get("/v1/models").json()
    assert [m["id"] for m in got["data"]] == ["llm", "sql"]
    assert "secret" not in json.dumps(got) and "/" not in json.dumps([m["root"] for m in got["data"]])
    assert client.get("/v1/models/sql").json() == {"id": "sql", "object": "model", "created": 0,
                                                   "owned_by": "inflight", "root": "sql", "parent": "llm"}
