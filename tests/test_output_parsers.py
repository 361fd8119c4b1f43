"""Every reasoning and tool-call parser (openai_server/reasoning.py, tool_parsers.py, tool_formats.py,
tool_pythonic.py) on recorded model outputs: the message each makes of the whole text is the one
written here, and a stream cut anywhere (every single cut, every pair of cuts; every triple on the
short ones, in the slow tier) adds up to exactly that message, so no tag and no half call ever reaches a field. The
outputs are in the formats the models write (tests/data/parser_outputs.jsonl), including text that
only looks like a tag, calls cut short by max_tokens, and blocks that are not calls."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from openai_server.parse import parse_output, parse_pieces
from openai_server.tool_parsers import PARSERS

DATA = Path(__file__).parent / "data" / "parser_outputs.jsonl"
CASES = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
REPO = Path(__file__).resolve().parents[1]


def _args(case):
    return case.get("reasoning"), case.get("tool"), case.get("tools"), case.get("prompt_state", "none")


def _expected(case):
    want = {"content": case["content"], "tool_calls": case.get("calls", [])}
    if "thinking" in case:
        want["reasoning"] = want["reasoning_content"] = case["thinking"]
    return want


def _ids(case):
    return f"{case.get('reasoning') or '-'}+{case.get('tool') or '-'}:{case['output'][:24]!r}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_the_whole_text_makes_the_recorded_message(case):
    reasoning, tool, tools, state = _args(case)
    got = parse_output(case["output"], reasoning, tool, tools, prompt=state)
    assert got == _expected(case)


def _check_cuts(case, cuts):
    reasoning, tool, tools, state = _args(case)
    text = case["output"]
    whole = parse_output(text, reasoning, tool, tools, prompt=state)
    for cut in cuts:
        bounds = (0,) + cut + (len(text),)
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        assert parse_pieces(pieces, reasoning, tool, tools, state) == whole, pieces


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_every_cut_of_the_stream_adds_up_to_the_whole_message(case):
    """Every single cut; every pair of cuts on the outputs up to 60 characters (the rest: below)."""
    n = len(case["output"])
    _check_cuts(case, [(i,) for i in range(n + 1)] + (list(itertools.combinations(range(1, n), 2)) if n <= 60 else []))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_every_pair_and_triple_of_cuts_adds_up_to_the_whole_message(case):
    n = len(case["output"])
    _check_cuts(case, list(itertools.combinations(range(1, n), 2))
                + (list(itertools.combinations(range(1, n), 3)) if n <= 70 else []))


def test_one_character_at_a_time_through_the_command(tmp_path):
    """`python -m openai_server.parse --jsonl --stream-chunk 1`: one message a line, the same as whole."""
    lines = [json.dumps({"output": c["output"], "tools": c.get("tools")}) for c in CASES
             if c.get("tool") == "qwen3_coder" and c.get("reasoning") == "qwen3" and c.get("prompt_state") is None]
    assert lines
    cmd = [sys.executable, "-m", "openai_server.parse", "--reasoning-parser", "qwen3", "--tool-call-parser",
           "qwen3_coder", "--jsonl"]
    whole = subprocess.run(cmd, input="\n".join(lines), capture_output=True, text=True, cwd=REPO, check=True)
    streamed = subprocess.run(cmd + ["--stream-chunk", "1"], input="\n".join(lines), capture_output=True,
                              text=True, cwd=REPO, check=True)
    messages = [json.loads(line) for line in whole.stdout.splitlines()]
    assert len(messages) == len(lines) and whole.stdout == streamed.stdout
    assert any(m["tool_calls"] and m["reasoning"] for m in messages)


@pytest.mark.parametrize("fmt", PARSERS)
def test_what_the_server_writes_in_a_format_its_parser_reads_back(fmt):
    """tool_grammar.calls_text (earlier calls in a prompt, the system message's example) in each
    format, read back by that format's parser: the same calls, no content."""
    from openai_server.tool_grammar import calls_text

    schemas = {"f": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"},
                                                      "l": {"type": "array"}}}}
    calls = [("f", {"n": 3, "s": 'a "q" <b>\n', "l": [1, None, True]}), ("f", {})]
    text = calls_text(fmt, calls)
    got = parse_output(text, None, fmt, [{"type": "function", "function": {"name": "f", "parameters": schemas["f"]}}])
    assert got["content"] is None, text
    assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == \
        [(n, {**a, "s": a["s"].strip()} if fmt == "qwen3_coder" and "s" in a else a) for n, a in calls], text


@pytest.mark.parametrize("fmt, template", [
    ("mistral", '[TOOL_CALLS][{{"name": "f", "arguments": {{"a": {}}}}}]'),
    ("hermes", '<tool_call>\n{{"name": "f", "arguments": {{"a": {}}}}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n{}\n</parameter>\n</function>\n</tool_call>"),
    ("pythonic", "[f(a={})]"),
])
def test_a_value_nested_past_what_python_reads_is_text_not_a_crash(fmt, template):
    """json.loads and ast raise RecursionError on 100,000 brackets (an output a prompt can ask
    for): the parser answers anyway."""
    text = template.format("[" * 100_000 + "]" * 100_000)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "array"}}}}}]
    got = parse_output(text, None, fmt, tools)
    assert got["content"] == text or (got["tool_calls"][0]["name"] == "f" and got["content"] is None)
