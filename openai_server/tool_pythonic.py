"""The `pythonic` tool-call format (vLLM's name; Llama 3.2 / Llama 4 and others): the output is a
Python list of calls, `[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]`, maybe
inside Llama 4's `<|python_start|>…<|python_end|>`. It is read with `ast` and each argument with
`ast.literal_eval` (never evaluated): literals only, JSON's `true`/`false`/`null` accepted too (what
a grammar that writes each value by its JSON schema makes). An output that is not such a list is
content; a list is held back until it closes, then sent as whole calls (the whole calls of a list
cut short by max_tokens too).
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

from openai_server.reasoning import held_back
from openai_server.tool_formats import SnapshotParser

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    raise ValueError("a call's function must be a name")


def parse_call_list(source: str) -> Optional[list[tuple[str, str]]]:
    """`[f(a=1), g()]` -> [(name, arguments JSON)], or None when it is not a list of calls."""
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) for c in tree.elts):
            return None
        calls = []
        for call in tree.elts:
            if call.args or any(k.arg is None for k in call.keywords):
                return None
            args = {k.arg: _literal(k.value) for k in call.keywords}
            calls.append((_name(call.func), json.dumps(args, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicParser(SnapshotParser):
    def scan(self, text: str, final: bool) -> list[tuple]:
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(PY_START):
            body = body[len(PY_START):].lstrip()
        elif not final and body and PY_START.startswith(body):
            return []
        if not body:
            return [("text", text)] if final else []
        head = _HEAD.match(body)
        if not body.startswith("[") or (head is None and body[1:].strip()) or (
                head is not None and body[head.end():].strip() and not body[head.end():].lstrip().startswith("(")):
            return [("text", text)]  # not a list of calls
        scan = self.bracket(body, 0, "'\"")
        end, done = scan.end, scan.elements
        if end is None:  # at the end, the calls before one cut short (max_tokens) are kept
            calls = parse_call_list(body[:done[-1]] + "]") if final and done else None
            if not final:
                return []
            return [("call", name, args) for name, args in calls] if calls else [("text", text)]
        calls = parse_call_list(body[:end])
        if calls is None:
            return [("text", text)]
        tail = body[end:]
        stripped = tail.lstrip()
        if stripped.startswith(PY_END):
            tail = stripped[len(PY_END):]
        elif not final and stripped and PY_END.startswith(stripped):
            tail = ""
        keep = 0 if final else held_back(tail, PY_END)
        return [("call", name, args) for name, args in calls] + [("text", tail[:len(tail) - keep])]
