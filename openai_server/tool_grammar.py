"""Each tool-call format written out: as text (a call in a conversation's history, the example in
the system message of a template without tools) and as the xgrammar structural tag that makes the
output calls in that format, each call's arguments following its function's schema (what
`tool_choice` "required" or a named function sends as the constraint). What the grammar lets out is
what the format's parser reads (tests/test_openai_structured.py checks each)."""
from __future__ import annotations

import json
from typing import Any

from openai_server.tool_formats import DS_CALL_CLOSE, DS_CALL_OPEN, DS_CALLS_CLOSE, DS_CALLS_OPEN, DS_SEP, QWEN_CLOSE, QWEN_OPEN
from openai_server.tool_mistral import MISTRAL_CALLS
from openai_server.tool_parsers import HERMES_CLOSE, HERMES_OPEN, LLAMA3_SEPARATOR

# Whitespace characters in a row within enforced arguments: room for indented JSON, no endless runs
# (a small model's failure mode when any whitespace is allowed).
MAX_ARGUMENT_WHITESPACE = 16

# format -> (what opens all calls, what ends them, the separator between two calls)
WRAPPERS = {"hermes": ("", "", "\n"), "llama3_json": ("", "", LLAMA3_SEPARATOR), "qwen3_coder": ("", "", "\n"),
            "mistral": (MISTRAL_CALLS + "[", "]", ", "), "pythonic": ("[", "]", ", "),
            "deepseek_v3": (DS_CALLS_OPEN, DS_CALLS_CLOSE, "\n")}


def _begin_end(fmt: str, name: str) -> tuple[str, str]:
    """The text before a call's arguments and after them."""
    quoted = json.dumps(name, ensure_ascii=False)
    return {"hermes": (f'{HERMES_OPEN}\n{{"name": {quoted}, "arguments": ', "}\n" + HERMES_CLOSE),
            "llama3_json": (f'{{"name": {quoted}, "parameters": ', "}"),
            "mistral": (f'{{"name": {quoted}, "arguments": ', "}"),
            "qwen3_coder": (f"{QWEN_OPEN}\n<function={name}>\n", f"\n</function>\n{QWEN_CLOSE}"),
            "pythonic": (f"{name}(", ")"),
            "deepseek_v3": (f"{DS_CALL_OPEN}function{DS_SEP}{name}\n```json\n", f"\n```{DS_CALL_CLOSE}")}[fmt]


def _arguments_text(fmt: str, args: Any) -> str:
    if fmt == "qwen3_coder":
        return "\n".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                         "</parameter>" for k, v in (args or {}).items())
    if fmt == "pythonic":
        return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in (args or {}).items())
    return json.dumps(args, ensure_ascii=False)


def calls_text(fmt: str, calls: list[tuple[str, Any]]) -> str:
    """[(name, arguments as an object)] as the model writes them in format `fmt`."""
    opening, closing, separator = WRAPPERS[fmt]
    written = []
    for name, args in calls:
        begin, end = _begin_end(fmt, name)
        written.append(begin + _arguments_text(fmt, args) + end)
    return opening + separator.join(written) + closing


def _arguments_format(fmt: str, schema: dict[str, Any]) -> dict[str, Any]:
    if fmt == "qwen3_coder":
        return {"type": "json_schema", "json_schema": schema, "style": "qwen_xml",
                "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE}
    if fmt != "pythonic":
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE}
    # name=value for each required property, in order, each value by its own schema (its JSON,
    # which the pythonic parser reads); the optional ones are left out.
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    properties = schema.get("properties") or {}
    elements: list[dict[str, Any]] = []
    for i, key in enumerate(schema.get("required") or []):
        sub = properties.get(key, {})
        sub = {**sub, **defs} if isinstance(sub, dict) else sub
        elements.append({"type": "const_string", "value": (", " if i else "") + f"{key}="})
        elements.append({"type": "json_schema", "json_schema": sub, "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE})
    if not elements:
        return {"type": "const_string", "value": ""}
    return {"type": "sequence", "elements": elements}


def structural_tag(fmt: str, functions: list[dict[str, Any]], named: bool, parallel: bool) -> dict[str, Any]:
    """Calls of `functions` in format `fmt`: exactly one (`named`), else at least one (only one
    unless `parallel`)."""
    tags = []
    for f in functions:
        begin, end = _begin_end(fmt, f["name"])
        tags.append({"type": "tag", "begin": begin, "end": end,
                     "content": _arguments_format(fmt, f.get("parameters") or {"type": "object"})})
    opening, closing, separator = WRAPPERS[fmt]
    calls = tags[0] if named else {"type": "tags_with_separator", "tags": tags, "separator": separator,
                                   "at_least_one": True, "stop_after_first": not parallel}
    if opening or closing:
        calls = {"type": "sequence", "elements": [{"type": "const_string", "value": opening}, calls,
                                                  {"type": "const_string", "value": closing}]}
    return {"type": "structural_tag", "format": calls}
