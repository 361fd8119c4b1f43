"""A reasoning model through the real servers, as `make serve` starts them (`inflight serve
--reasoning-parser qwen3 --tool-call-parser qwen3_coder`: tritonserver and its OpenAI port), asked
with the official `openai` SDK: a tiny random Qwen3 in Qwen3's chat format (tests/qwen3_chat.py).

A random model writes random text, so what it writes is pinned down by the grammar: with thinking
on, a thinking budget makes the output `<think>`, at most that many tokens, `</think>`, then the
answer's constraint (constraints.answer_only); with `enable_thinking: false` the template closes
the thinking and the constraint holds from the first token. Each chat answer is checked against
the raw text the same prompt and constraint make on /v1/completions, split by the parser
(reasoning.split_reasoning): reasoning and content split right, streamed and not. The Triton door
splits the same way when a request sets `reasoning_parser` (`reasoning_output`)."""
from __future__ import annotations

import json

import pytest

from serving.triton_launcher import free_port

from .conftest import inflight_serve, requires_tritonserver, stop_serve
from .raw_requests import array, grpc_stream

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = requires_tritonserver

ASK = [{"role": "user", "content": "Is it sunny in Paris?"}]
CHOICE = ["yes", "no"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                                                                         "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_repository):
    from backend.text.tokenizer import Tokenizer
    from qwen3_chat import make_qwen3_chat

    path = make_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat"))
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    proc, _ = inflight_serve(
        ["--model-repository", str(model_repository),  # rendered for this run: every input of the table
         "--model-path", str(path), "--host", "127.0.0.1", "--http-port", str(ports["http"]),
         "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
         "--openai-port", str(ports["openai"]), "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder",
         "--param", "max_model_len=512", "--param", "max_num_seqs=8", "--param", "cpu_kv_cache_tokens=8192"],
        timeout=300)
    try:
        yield (openai.OpenAI(base_url=f"http://127.0.0.1:{ports['openai']}/v1", api_key="unused", max_retries=0,
                             timeout=120), Tokenizer.from_dir(path), f"127.0.0.1:{ports['grpc']}")
    finally:
        stop_serve(proc)


def raw_text(api, tokenizer, spec, **template):
    """What the model writes for ASK under the constraint `spec`, unparsed (/v1/completions)."""
    ids = tokenizer.encode(tokenizer.render_chat(ASK, **template), add_special_tokens=False)
    extra = {"structured_outputs": spec} if spec is not None else {}
    answer = api.completions.create(model="llm", prompt=ids, max_tokens=40, temperature=0, extra_body=extra)
    assert answer.usage.prompt_tokens == len(ids)
    return answer.choices[0]


def streamed(api, **kw):
    """(reasoning, reasoning_content, content, tool calls {index: [name, arguments]}, finish reason) of a stream."""
    reasoning, older, content, calls, finish = "", "", "", {}, None
    for chunk in api.chat.completions.create(model="llm", messages=ASK, stream=True, **kw):
        choice = chunk.choices[0]
        delta = choice.delta.model_dump()
        reasoning += delta.get("reasoning") or ""
        older += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += (call.get("function") or {}).get("name") or ""
            entry[1] += (call.get("function") or {}).get("arguments") or ""
        finish = choice.finish_reason or finish
    return reasoning, older, content, calls, finish


@pytest.mark.parametrize("budget", [0, 6])
def test_thinking_then_a_constrained_answer_split_streamed_and_not(served, budget):
    from openai_server.constraints import answer_only
    from openai_server.reasoning import split_reasoning

    api, tokenizer, _ = served
    extra = {"thinking_token_budget": budget, "guided_choice": CHOICE}
    message = api.chat.completions.create(model="llm", messages=ASK, max_tokens=40, temperature=0,
                                          extra_body=extra).choices[0]
    raw = raw_text(api, tokenizer, answer_only({"choice": CHOICE}, "guided_choice", "qwen3", "none", budget))
    assert raw.text.startswith("<think>") and "</think>" in raw.text, raw.text
    thought, answer = split_reasoning(raw.text, "qwen3")
    fields = message.message.model_dump()
    assert (fields["reasoning"], fields["reasoning_content"], fields["content"]) == (thought, thought, answer)
    assert answer in CHOICE and message.finish_reason == "stop"
    if budget == 0:
        assert thought == ""  # </think> forced at once
    assert streamed(api, max_tokens=40, temperature=0, extra_body=extra) == (thought, thought, answer, {}, "stop")


def test_thinking_off_constrains_from_the_first_token_and_has_no_reasoning(served):
    api, tokenizer, _ = served
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "guided_choice": CHOICE}
    answer = api.chat.completions.create(model="llm", messages=ASK, max_tokens=40, temperature=0, extra_body=extra)
    message = answer.choices[0].message
    raw = raw_text(api, tokenizer, {"choice": CHOICE}, enable_thinking=False)
    assert message.content == raw.text and raw.text in CHOICE
    closed = tokenizer.encode(tokenizer.render_chat(ASK, enable_thinking=False), add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(closed) == len(tokenizer.encode(tokenizer.render_chat(ASK),
                                                                             add_special_tokens=False)) + 6
    assert "reasoning" not in message.model_dump() or message.model_dump()["reasoning"] is None
    assert streamed(api, max_tokens=40, temperature=0, extra_body=extra) == ("", "", raw.text, {}, "stop")


def test_unconstrained_answers_are_split_as_the_raw_text_is(served):
    from openai_server.reasoning import split_reasoning

    api, tokenizer, _ = served
    message = api.chat.completions.create(model="llm", messages=ASK, max_tokens=40, temperature=0).choices[0]
    thought, answer = split_reasoning(raw_text(api, tokenizer, None).text, "qwen3")
    fields = message.message.model_dump()
    assert (fields.get("reasoning"), fields["content"]) == (thought, answer)
    joined = streamed(api, max_tokens=40, temperature=0)
    assert joined[:3] == (thought or "", thought or "", answer or "")


def test_a_required_tool_call_follows_the_thinking(served):
    api, _, _ = served
    kw = dict(tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0,
              extra_body={"thinking_token_budget": 4})
    choice = api.chat.completions.create(model="llm", messages=ASK, **kw).choices[0]
    fields = choice.message.model_dump()
    assert isinstance(fields["reasoning"], str) and "think>" not in fields["reasoning"]
    call = choice.message.tool_calls[0].function
    assert call.name == "get_weather" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    reasoning, _, content, calls, finish = streamed(api, **kw)
    assert reasoning == fields["reasoning"] and calls == {0: ["get_weather", call.arguments]} and finish == "tool_calls"


@pytest.mark.parametrize("stream", [True, False])
def test_the_triton_door_splits_the_same_when_asked(served, stream):
    """gRPC, the vLLM backend's format plus the reasoning_parser input: reasoning_output holds the
    thinking, text_output the answer; without the input, text_output is the raw text."""
    from openai_server.constraints import answer_only
    from openai_server.reasoning import split_reasoning

    api, tokenizer, grpc_url = served
    spec = answer_only({"choice": CHOICE}, "guided_choice", "qwen3", "none", 6)
    sampling = json.dumps({"max_tokens": 40, "temperature": 0, "structured_outputs": spec})
    inputs = {"text_input": array(tokenizer.render_chat(ASK)), "stream": array(stream),
              "sampling_parameters": array(sampling), "exclude_input_in_output": array(True)}
    plain = grpc_stream(grpc_url, inputs)
    raw = "".join(r["text_output"][0].decode() for r in plain)
    assert "reasoning_output" not in plain[-1] and raw.startswith("<think>")
    split = grpc_stream(grpc_url, {**inputs, "reasoning_parser": array("qwen3")})
    thought = "".join(r["reasoning_output"][0].decode() for r in split)
    answer = "".join(r["text_output"][0].decode() for r in split)
    assert (thought, answer) == split_reasoning(raw, "qwen3") and answer in CHOICE
