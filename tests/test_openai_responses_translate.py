"""/v1/responses without a server (openai_server/responses_api.py, responses_stream.py): the chat body
a Responses body becomes, what is refused by name, and the events a chat stream becomes. The SDK
against the real stack: tests/e2e/test_openai_responses_api.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from openai_server.responses_api import Answer, events, to_chat
from openai_server.translate import APIError

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_items_become_the_chats_turns():
    chat = to_chat({"model": "llm", "instructions": "Be brief.", "max_output_tokens": 7, "input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]}],
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_completion_tokens"] == 7 and "stream" not in chat


def test_format_effort_and_stream():
    schema = {"type": "object"}
    chat = to_chat({"model": "llm", "input": "hi", "stream": True, "reasoning": {"effort": "minimal"},
                    "text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                             "strict": True}}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "minimal"}
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    on = to_chat({"model": "llm", "input": "hi", "reasoning": {"effort": "high"},
                  "chat_template_kwargs": {"enable_thinking": False}})  # the request's own win
    assert on["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "high"}
    assert to_chat({"model": "llm", "input": "hi", "reasoning": {"effort": "low"}})["chat_template_kwargs"][
        "enable_thinking"] is True
    assert "response_format" not in to_chat({"model": "llm", "input": "hi", "text": {"format": {"type": "text"}}})


@pytest.mark.parametrize("field,value", [
    ("store", True), ("previous_response_id", "resp_1"), ("background", True), ("truncation", "auto"),
    ("include", ["reasoning.encrypted_content"]), ("tools", [{"type": "web_search"}]), ("n", 2),
    ("input", [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ("input", [{"type": "custom_tool_call"}]), ("input", []), ("reasoning", {"effort": "max"}),
    ("text", {"format": {"type": "grammar"}}), ("tool_choice", {"type": "web_search"})])
def test_refusals_name_the_field(field, value):
    with pytest.raises(APIError) as err:
        to_chat({"model": "llm", "input": "hi", field: value})
    assert err.value.status == 400 and err.value.param == field and field in err.value.message


def sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def chunk(**delta):
    finish = delta.pop("finish", None)
    return sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def run(chunks):
    async def gen():
        for c in chunks:
            yield c

    async def collect():
        answer = Answer({"model": "llm"}, lambda text: len(text.split()))
        return [json.loads(e.decode().split("data: ", 1)[1]) async for e in events(gen(), answer)]
    return asyncio.run(collect())


def test_a_chat_stream_becomes_the_responses_events_in_order():
    out = run([chunk(role="assistant", reasoning="so ", reasoning_content="so "), chunk(reasoning="sunny"),
               chunk(content="It is"), chunk(content=" sunny."),
               chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                  "function": {"name": "f", "arguments": ""}}]),
               chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a": '}}]),
               chunk(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
               chunk(tool_calls=[{"index": 1, "id": "call_2", "type": "function",
                                  "function": {"name": "g", "arguments": "{}"}}], finish="tool_calls"),
               sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}),
               sse("[DONE]")])
    kinds = [e["type"] for e in out]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "so sunny"  # reasoning_content (the same text) not doubled
    assert final["output"][1]["content"][0]["text"] == out[13]["text"] == "It is sunny."
    assert final["output"][2] | {"id": None} == {"id": None, "type": "function_call", "call_id": "call_1", "name": "f",
                                                 "arguments": '{"a": 1}', "status": "completed"}
    assert final["usage"] == {"input_tokens": 5, "output_tokens": 9, "total_tokens": 14,
                              "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 2}}
    item_ids = {e["item_id"] for e in out if "delta" in e}
    assert item_ids == {o["id"] for o in final["output"]}


def test_a_cut_answer_is_incomplete_and_an_error_is_an_error_event():
    out = run([chunk(content="abc", finish="length"), sse("[DONE]")])
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    out = run([chunk(content="a"), sse({"error": {"message": "boom", "type": "server_error", "param": None,
                                                  "code": "triton_error"}})])
    assert out[-1]["type"] == "error" and out[-1]["message"] == "boom"
