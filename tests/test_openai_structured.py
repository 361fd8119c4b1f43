"""The OpenAI layer of structured outputs and tool calling, without a server: response_format and
vLLM's extra fields into the engine's structured_outputs; tools, tool_choice and parallel_tool_calls
(checked, rendered through the template or its system-message default, enforced by a structural
tag); tool calls read out of text, streamed pieces joining to the whole answer; and, on the
random-weight model, the enforced tag yields calls the parser reads and the schemas accept."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from backend import LLM, SamplingParams
from backend.text.tokenizer import Tokenizer
from openai_server.responses import ChoiceState, Piece, Reply
from openai_server.tool_parsers import PARSERS, ToolCallParser, parse_tool_calls
from openai_server.tools import ToolCalling
from openai_server.translate import APIError, parse_chat, parse_completion

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 8},
                                                "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(render=lambda messages, **kw: [1, 2], parser="hermes", **body):
    return parse_chat({"model": "llm", "messages": USER, **body}, render, parser)


def test_response_format_and_vllm_extras_become_the_engines_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat(response_format=rf).sampling["structured_outputs"] == {"json": schema}
    assert chat(response_format={"type": "json_object"}).sampling["structured_outputs"] == {"json_object": True}
    assert "structured_outputs" not in chat(response_format={"type": "text"}).sampling
    completion = parse_completion({"model": "llm", "prompt": "x", "guided_choice": ["a", "b"]})
    assert completion.sampling["structured_outputs"] == {"choice": ["a", "b"]}
    extra = chat(structured_outputs={"regex": "[0-9]+"}).sampling["structured_outputs"]
    assert extra == {"regex": "[0-9]+"}
    SamplingParams.from_dict(chat(response_format=rf).sampling)  # what the engine will read


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}}, "response_format"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool"}]}, "messages"),
])
def test_bad_values_are_a_400_naming_the_parameter(body, param):
    with pytest.raises(APIError) as err:
        chat(**body)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_tool_choice_sets_the_constraint_and_the_parser():
    assert chat(tools=[WEATHER]).tools.choice == "auto" and "structured_outputs" not in chat(tools=[WEATHER]).sampling
    assert "structured_outputs" not in chat(tools=[WEATHER], tool_choice="none").sampling
    required = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    fmt = required.sampling["structured_outputs"]["structural_tag"]["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"] and fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                                                 '<tool_call>\n{"name": "get_time", "arguments": ']
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 parser="llama3_json")
    tag = named.sampling["structured_outputs"]["structural_tag"]["format"]
    assert tag["begin"] == '{"name": "get_time", "parameters": ' and tag["content"]["json_schema"] == SCHEMAS["get_time"]


def test_tools_reach_the_template_or_the_system_message(tmp_path):
    from smollm2 import smollm2_dir

    tok = Tokenizer.from_dir(smollm2_dir())  # its template has no tools section
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    seen = []
    chat(render=lambda m, **kw: seen.append(tok.render_chat(m, **kw)) or [1], tools=[WEATHER], messages=history)
    prompt = seen[0]
    assert prompt.startswith("<|im_start|>system\nYou can call these functions") and '"get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response>" in prompt
    # a template that reads `tools` gets them, and each call's arguments as an object
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}<{{ c.function.arguments.city }}>{% endfor %}{{ m.content or '' }}"
                "{% endfor %}")
    tok.config["chat_template"] = template
    seen.clear()
    chat(render=lambda m, **kw: seen.append(tok.render_chat(m, add_generation_prompt=False, **kw)) or [1],
         tools=[WEATHER], messages=history)
    assert seen[0] == "[get_weather]Weather in Paris?<Paris>21 C, sunny"


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P\\"aris }", '
          '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"arguments": {"zone": 2}, "name": "get_time"}\n</tool_call>')
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}; {"name": "get_time", "parameters": {"zone": -3}}'


@pytest.mark.parametrize("text, fmt", [(HERMES, "hermes"), (LLAMA3, "llama3_json")])
def test_streamed_tool_calls_join_to_the_whole_answer(text, fmt):
    content, calls = parse_tool_calls(text, fmt)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    rng = random.Random(3)
    for _ in range(20):  # any split of the text into stream pieces
        parser, events, at = ToolCallParser(fmt), [], 0
        while at < len(text):
            step = rng.randint(1, 9)
            events += parser.feed(text[at:at + step])
            at += step
        events += parser.finish()
        assert "".join(e[1] for e in events if e[0] == "content") == (content or "")
        args = ["".join(e[2] for e in events if e[0] == "args" and e[1] == i) for i in range(2)]
        assert args == [c["function"]["arguments"] for c in calls]
        names = [e[3] for e in events if e[0] == "call"]
        assert names == ["get_weather", "get_time"]


def test_text_that_only_looks_like_a_call_stays_content():
    assert parse_tool_calls("<tool_call> not json </tool_call>", "hermes") == ("<tool_call> not json </tool_call>", [])
    assert parse_tool_calls("Hello, I am <tool", "hermes") == ("Hello, I am <tool", [])
    assert parse_tool_calls('Answer: {"name": "x"}', "llama3_json") == ('Answer: {"name": "x"}', [])


def test_replies_carry_openai_tool_calls_and_finish_reasons():
    tools = ToolCalling.from_body({"tools": [WEATHER, TIME]}, "hermes")
    state = ChoiceState()
    state.add(Piece(text=HERMES, num_tokens=5, finish_reason="stop"))
    message = Reply("id", "llm", True, tools=tools).body([state], 1, False)["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] == "Let me check.\n"
    assert [c["function"]["name"] for c in message["message"]["tool_calls"]] == ["get_weather", "get_time"]
    single = ToolCalling.from_body({"tools": [WEATHER, TIME], "parallel_tool_calls": False}, "hermes")
    assert len(Reply("id", "llm", True, tools=single).body([state], 1, False)["choices"][0]["message"]["tool_calls"]) == 1
    named = ToolCalling.from_body({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
        "name": "get_weather"}}}, "hermes")
    assert Reply("id", "llm", True, tools=named).body([state], 1, False)["choices"][0]["finish_reason"] == "stop"
    # streamed: the id and name first, then the arguments in pieces
    reply, state, deltas = Reply("id", "llm", True, tools=tools), ChoiceState(), []
    pieces = [HERMES[i:i + 7] for i in range(0, len(HERMES), 7)]
    for i, text in enumerate(pieces):
        piece = Piece(text=text, finish_reason="stop" if i == len(pieces) - 1 else None)
        state.add(piece)
        deltas.append(reply.chunk(0, piece, state, i == 0, False, False)["choices"][0])
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls if c["index"] == 0) == json.dumps(
        {"city": 'P"aris }', "unit": "C"})
    assert len([c for c in calls if c["index"] == 0 and c["function"]["arguments"]]) > 2  # in pieces
    assert deltas[-1]["finish_reason"] == "tool_calls" and all(d["finish_reason"] is None for d in deltas[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("parser", PARSERS)
def test_the_enforced_format_is_what_the_parser_reads(default_model_dir, parser):
    llm = LLM(str(default_model_dir), max_model_len=512)
    for choice, parallel in (("required", True), ("required", False),
                             ({"type": "function", "function": {"name": "get_time"}}, True)):
        tools = ToolCalling.from_body({"tools": [WEATHER, TIME], "tool_choice": choice,
                                       "parallel_tool_calls": parallel}, parser)
        spec = {"structural_tag": tools.structural_tag()}
        for seed in range(3):
            out = llm.generate("x", SamplingParams(max_tokens=300 if parser == "deepseek_v3" else 120,  # its long tags
                                                   temperature=1.0, seed=seed,
                                                   structured_outputs=spec))[0]
            content, calls = parse_tool_calls(out.text, parser, SCHEMAS)
            assert calls and content is None, out.text
            if len(calls) == 1 or not (parallel and choice == "required"):  # one call: then the grammar ends
                assert len(calls) == 1 and out.finish_reason == "stop", out.text
            elif out.finish_reason == "length":  # parallel calls may go on until max_tokens: the last is cut
                calls = calls[:-1]
            for c in calls:
                assert tools.named is False or c["function"]["name"] == "get_time"
                jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
