"""API keys, Triton's restricted APIs, /tokenize and /detokenize, and /v1/responses through the
real servers, as `inflight serve` starts them, asked with the official `openai` SDK. One server
for all: the tiny random Qwen3 in Qwen3's chat format (tests/qwen3_chat.py), `--api-key` with two
keys, Triton's repository and statistics APIs behind a header (`--triton-arg`)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from serving.triton_launcher import free_port

from .conftest import inflight_serve, requires_tritonserver, stop_serve

openai = pytest.importorskip("openai")
pytestmark = requires_tritonserver

KEY, OTHER_KEY = "sk-inflight-test", "second-key"
ADMIN = ("admin-key", "s3cret")


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_repository):
    from backend.text.tokenizer import Tokenizer
    from qwen3_chat import make_qwen3_chat

    path = make_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat"))
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    restricted = f"model-repository,statistics:{ADMIN[0]}={ADMIN[1]}"
    proc, _ = inflight_serve(
        ["--model-repository", str(model_repository), "--model-path", str(path), "--host", "127.0.0.1",
         "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
         "--metrics-port", str(ports["metrics"]), "--openai-port", str(ports["openai"]),
         "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--api-key", KEY, OTHER_KEY,
         f"--triton-arg=--http-restricted-api={restricted}", f"--triton-arg=--grpc-restricted-protocol={restricted}",
         "--param", "max_model_len=512", "--param", "max_num_seqs=8", "--param", "cpu_kv_cache_tokens=8192"],
        timeout=300)
    try:
        yield {"url": f"http://127.0.0.1:{ports['openai']}", "tokenizer": Tokenizer.from_dir(path),
               "http": f"127.0.0.1:{ports['http']}", "grpc": f"127.0.0.1:{ports['grpc']}"}
    finally:
        stop_serve(proc)


def sdk(served, key=KEY):
    return openai.OpenAI(base_url=f"{served['url']}/v1", api_key=key, max_retries=0, timeout=120)


def get(url: str, headers: dict | None = None, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# -- keys --------------------------------------------------------------------------------------------

def test_the_key_is_wanted_on_v1_and_health_and_metrics_stay_open(served):
    for key in ("not-the-key", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as err:
            sdk(served, key).models.list()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    no_key = openai.OpenAI(base_url=f"{served['url']}/v1", api_key="unused", max_retries=0,
                           default_headers={"Authorization": ""})  # the SDK sends no key
    with pytest.raises(openai.AuthenticationError):
        no_key.models.list()
    assert [m.id for m in sdk(served).models.list().data] == ["llm"]
    assert [m.id for m in sdk(served, OTHER_KEY).models.list().data] == ["llm"]
    status, body = get(f"{served['url']}/v1/chat/completions", data=b"{}")
    assert status == 401 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert get(f"{served['url']}/metrics")[0] == 200
    assert get(f"{served['url']}/health")[0] == 200


def test_tritons_restricted_apis_want_their_header(served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    index = f"http://{served['http']}/v2/repository/index"
    assert get(index, data=b"{}")[0] == 403
    status, body = get(index, headers={ADMIN[0]: ADMIN[1]}, data=b"{}")
    assert status == 200 and "llm" in body.decode()
    assert get(f"http://{served['http']}/v2/models/llm/ready")[0] == 200  # health stays open
    client = grpcclient.InferenceServerClient(served["grpc"])
    with pytest.raises(InferenceServerException):
        client.get_inference_statistics("llm")
    assert client.get_inference_statistics(  # gRPC: the header name gets a prefix
        "llm", headers={f"triton-grpc-protocol-{ADMIN[0]}": ADMIN[1]}, as_json=True)["model_stats"]
    assert client.is_model_ready("llm")


# -- /tokenize and /detokenize ---------------------------------------------------------------------

def post(served, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    status, raw = get(f"{served['url']}{path}", headers={"Authorization": f"Bearer {key}"} if key else {},
                      data=json.dumps(body).encode())
    return status, json.loads(raw)


def test_tokenize_and_detokenize_round_trip_as_the_tokenizer(served):
    tokenizer, text = served["tokenizer"], "Is it sunny in Paris? <think> maybe"
    status, got = post(served, "/tokenize", {"model": "llm", "prompt": text})
    assert status == 200 and got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 512  # the served --param
    status, back = post(served, "/detokenize", {"model": "llm", "tokens": got["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.decode(got["tokens"], skip_special_tokens=False)}
    status, bare = post(served, "/tokenize", {"model": "llm", "prompt": text, "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False) != got["tokens"]  # no BOS
    assert post(served, "/detokenize", {"tokens": bare["tokens"]}) == (200, {"prompt": text})
    # a chat: the prompt /v1/chat/completions would send (its usage counts the same tokens)
    ask = [{"role": "user", "content": "Hi"}]
    status, chat = post(served, "/tokenize", {"messages": ask, "chat_template_kwargs": {"enable_thinking": False},
                                              "return_token_strs": True})
    expected = tokenizer.encode(tokenizer.render_chat(ask, enable_thinking=False), add_special_tokens=False)
    assert status == 200 and chat["tokens"] == expected
    assert chat["token_strs"] == [tokenizer.id_to_token(i) for i in expected]
    used = sdk(served).chat.completions.create(model="llm", messages=ask, max_tokens=1,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert used.usage.prompt_tokens == chat["count"]
    # refusals name the field; no key: 401
    assert post(served, "/detokenize", {"tokens": [10 ** 9]})[1]["error"]["param"] == "tokens"
    assert post(served, "/tokenize", {"prompt": "x", "messages": ask})[0] == 400
    assert post(served, "/tokenize", {"prompt": "x"}, key=None)[0] == 401
    assert post(served, "/detokenize", {"tokens": [1]}, key="wrong")[0] == 401


# -- /v1/responses ---------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"]}}
NO_THINKING = {"effort": "none"}  # the template's enable_thinking: false


def test_a_plain_response_is_the_chats_answer(served):
    api = sdk(served)
    r = api.responses.create(model="llm", input="Is it sunny in Paris?", instructions="Answer briefly.",
                             max_output_tokens=12, temperature=0, reasoning=NO_THINKING)
    chat = api.chat.completions.create(model="llm", max_completion_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Is it sunny in Paris?"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.object == "response" and r.id.startswith("resp_") and r.store is False
    assert r.output_text == chat.choices[0].message.content and r.output[0].type == "message"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_a_forced_function_call(served):
    r = sdk(served).responses.create(
        model="llm", input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}],
        tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
        temperature=0, reasoning=NO_THINKING)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 8
    # the call and its output sent back as items: the next turn renders them as the chat's tool turn
    follow = sdk(served).responses.create(
        model="llm", max_output_tokens=4, temperature=0, reasoning=NO_THINKING, tools=[WEATHER], input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_a_json_schema_format_parses_and_validates(served):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    # sampled (a greedy random model may spend every token on the whitespace JSON allows)
    for seed in range(2):
        r = sdk(served).responses.create(model="llm", input="Is it sunny in Paris?", max_output_tokens=440,
                                         temperature=1.0, reasoning=NO_THINKING, extra_body={"seed": seed},
                                         text={"format": {"type": "json_schema", "name": "verdict", "schema": schema,
                                                          "strict": True}})
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), schema)


def test_a_streamed_response_has_the_events_in_order_and_adds_up(served):
    """Thinking on (reasoning.effort), at most 4 tokens of it (vLLM's thinking_token_budget), then a
    JSON answer: both items streamed, each the same as the whole answer with the same seed."""
    api = sdk(served)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    kw = dict(model="llm", input="Is it sunny in Paris?", max_output_tokens=200, temperature=1.0,
              reasoning={"effort": "high"}, extra_body={"thinking_token_budget": 4, "seed": 1},
              text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}})
    whole = api.responses.create(**kw)
    events = list(api.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                       "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert done.text == text == final.output_text == whole.output_text
    assert final.output[0].content[0].text == reasoning == whole.output[0].content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    for added, closed in (("response.output_item.added", "response.output_item.done"),
                          ("response.content_part.added", "response.content_part.done")):
        assert kinds.count(added) == kinds.count(closed) == 2


def test_a_streamed_function_call(served):
    events = list(sdk(served).responses.create(
        model="llm", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=60,
        temperature=0, reasoning=NO_THINKING, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather" and done.arguments == deltas and "city" in json.loads(deltas)
    assert events[-1].response.output[-1].arguments == deltas


@pytest.mark.parametrize("field,value", [("store", True), ("previous_response_id", "resp_1"),
                                         ("tools", [{"type": "web_search"}])])
def test_what_a_stateless_server_cannot_do_is_a_400_naming_it(served, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        sdk(served).responses.create(model="llm", input="hi", **{field: value})
    assert err.value.body["param"] == field and field.split("_")[0] in err.value.body["message"]
