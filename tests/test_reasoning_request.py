"""The request side of reasoning models (openai_server/reasoning_request.py, constraints.answer_only)
and the reply side (responses.Reply): chat_template_kwargs reach the template and cannot replace
the server's variables; thinking_token_budget is checked; a constraint moved after the thinking is
one grammar that xgrammar itself reads as "think, then the answer" (and a budget of 0 leaves only
`</think>`); the message and each delta carry `reasoning` and `reasoning_content`."""
from __future__ import annotations

import json

import pytest

from openai_server.constraints import answer_only
from openai_server.reasoning import prompt_state
from openai_server.reasoning_request import Thinking, parse_chat_request
from openai_server.responses import ChoiceState, Piece, Reply
from openai_server.translate import APIError

xgr = pytest.importorskip("xgrammar")  # at collection: its import (torch's) is not this test's time
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

USER = [{"role": "user", "content": "Hi"}]


def request(reasoning="qwen3", render=None, **body):
    return parse_chat_request({"model": "llm", "messages": USER, **body}, render or (lambda m, **kw: "p"),
                              "hermes", reasoning)


def test_chat_template_kwargs_reach_the_template_and_the_prompt_decides_the_state():
    seen = []

    def render(messages, **kw):
        seen.append(kw)
        return "<|im_start|>assistant\n<think>\n\n</think>\n\n" if kw.get("enable_thinking") is False else "x<think>\n"

    _, thinking = request(render=render, chat_template_kwargs={"enable_thinking": False, "custom": [1]})
    assert seen[-1] == {"enable_thinking": False, "custom": [1]} and thinking == Thinking("qwen3", "closed")
    assert request(render=render)[1] == Thinking("qwen3", "open")
    assert request(None, render=render, chat_template_kwargs={"enable_thinking": False})[1] == Thinking()
    assert [prompt_state(t) for t in ("a<think>\n", "a</think>\n\n", "a")] == ["open", "closed", "none"]


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": True}, "thinking_token_budget"),
    ({"guided_grammar": 'start: "a"'}, "guided_grammar"),  # Lark cannot follow the thinking
])
def test_bad_reasoning_fields_are_a_400_naming_them(body, param):
    with pytest.raises(APIError) as err:
        request(**body)
    assert err.value.status == 400 and err.value.param == param


def test_a_budget_needs_a_reasoning_parser():
    with pytest.raises(APIError, match="--reasoning-parser") as err:
        request(None, thinking_token_budget=10)
    assert err.value.param == "thinking_token_budget"


def test_the_constraint_follows_the_thinking_and_the_budget_is_enforced():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    gen, _ = request(render=lambda m, **kw: "<|im_start|>assistant\n",
                     response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    grammar = xgr.Grammar.from_structural_tag(json.dumps(gen.sampling["structured_outputs"]["structural_tag"]))
    assert accepts(grammar, '<think>\nlet me see: {"a": "x"}\n</think>\n\n{"a": 1}')
    assert not accepts(grammar, '{"a": 1}') and not accepts(grammar, '<think>x</think>\n\n{"a": "x"}')
    # thinking off: the constraint is the request's own, from the first token
    closed, _ = request(render=lambda m, **kw: "<think>\n\n</think>\n\n", guided_regex="[0-9]+")
    assert closed.sampling["structured_outputs"] == {"regex": "[0-9]+"}
    # deepseek_r1 (and a prompt that opened the thinking): no <think> to write
    spec = answer_only({"choice": ["a", "b"]}, "guided_choice", "deepseek_r1", "none", 0)
    grammar = xgr.Grammar.from_structural_tag(json.dumps(spec["structural_tag"]))
    assert accepts(grammar, "</think>b") and not accepts(grammar, "<think></think>b")
    budget, _ = request(thinking_token_budget=3)
    tag = budget.sampling["structured_outputs"]["structural_tag"]["format"]["elements"][0]
    assert tag["begin"] == "<think>" and tag["content"] == {"type": "any_text", "max_tokens": 3}


def test_the_message_and_every_delta_carry_both_reasoning_fields():
    whole = Reply("id", "llm", chat=True, thinking=Thinking("qwen3"))
    state = ChoiceState()
    state.add(Piece(text="<think>a</think>\n\nb", finish_reason="stop"))
    message = whole.body([state], 1, False)["choices"][0]["message"]
    assert message == {"role": "assistant", "reasoning": "a", "reasoning_content": "a", "content": "b"}
    stream, deltas, state = Reply("id", "llm", chat=True, thinking=Thinking("qwen3")), [], ChoiceState()
    for i, text in enumerate(["<thi", "nk>a</th", "ink>\n", "\nb", ""]):
        piece = Piece(text=text, finish_reason="stop" if i == 4 else None)
        state.add(piece)
        deltas.append(stream.chunk(0, piece, state, i == 0, False, False)["choices"][0]["delta"])
    assert "".join(d.get("reasoning", "") for d in deltas) == "a"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "b"
    assert not any("<" in (d.get("content") or "") + d.get("reasoning", "") for d in deltas)


def test_include_reasoning_false_drops_the_reasoning_field_and_never_leaks_it_into_content():
    """vLLM's include_reasoning (default true): false answers with content only, streamed and not."""
    _, thinking = request(include_reasoning=False)
    assert thinking == Thinking("qwen3", "none", False) and request()[1].include
    with pytest.raises(APIError, match="include_reasoning must be a boolean"):
        request(include_reasoning="no")
    whole = Reply("id", "llm", chat=True, thinking=thinking)
    state = ChoiceState()
    state.add(Piece(text="<think>a</think>\n\nb", finish_reason="stop"))
    assert whole.body([state], 1, False)["choices"][0]["message"] == {"role": "assistant", "content": "b"}
    stream, deltas, state = Reply("id", "llm", chat=True, thinking=thinking), [], ChoiceState()
    for i, text in enumerate(["<thi", "nk>a</th", "ink>\n", "\nb", ""]):
        piece = Piece(text=text, finish_reason="stop" if i == 4 else None)
        state.add(piece)
        deltas.append(stream.chunk(0, piece, state, i == 0, False, False)["choices"][0]["delta"])
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "b"
