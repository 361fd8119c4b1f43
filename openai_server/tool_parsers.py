"""Tool calls read out of generated text, incrementally: the formats `--tool-call-parser` names
(vLLM's): `hermes` and `llama3_json` here; `qwen3_coder` and `deepseek_v3` (tool_formats.py), `mistral`
(tool_mistral.py) and `pythonic` (tool_pythonic.py), behind the same interface (`make_parser`).

- `hermes`: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number of them,
  text allowed around them (Hermes, Qwen 2.5, and what the system-message default asks for);
- `llama3_json`: the output is `{"name": "f", "parameters": {...}}` objects separated by `; `
  (Llama 3.1/3.2's JSON tool calling); an output that does not start with `{` is plain content.
Either format takes "arguments" or "parameters".

`ToolCallParser.feed(text)` returns events as the text arrives: ("content", text), ("call", index,
id, name) once a call's name is known, ("args", index, text) for each piece of its arguments, so a
stream can send OpenAI's `delta.tool_calls` with incremental `arguments`. Text that may still turn
out to open a call is held back. The whole answer is `feed(all)` then `finish()`: one parser for
both, so the streamed pieces always join to the non-streamed answer.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from openai_server.reasoning import held_back
from openai_server.tool_formats import DeepSeekV3Parser, Qwen3CoderParser, new_call_id
from openai_server.tool_mistral import MistralParser
from openai_server.tool_pythonic import PythonicParser

FORMATS = {"qwen3_coder": Qwen3CoderParser, "deepseek_v3": DeepSeekV3Parser, "mistral": MistralParser,
           "pythonic": PythonicParser}
PARSERS = ("hermes", "llama3_json") + tuple(FORMATS)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_SEPARATOR = "; "
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class _CallObject:
    """One call's JSON object, scanned as it arrives: where its arguments start and end, where the
    object ends, without parsing it twice."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_string = self.escaped = False
        self.scanned = 0
        self.name: Optional[str] = None
        self.args_start: Optional[int] = None
        self.args_end: Optional[int] = None
        self.end: Optional[int] = None  # index after its closing brace
        self.args_sent = 0

    def feed(self, more: str) -> None:
        self.text += more
        if self.name is None and (m := _HEAD.match(self.text)):
            self.name = json.loads(f'"{m.group(1)}"')
            self.args_start = m.end()
        for j in range(self.scanned, len(self.text)):
            c = self.text[j]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                continue
            if (self.args_start is not None and self.args_end is None and j >= self.args_start
                    and self.depth == 1 and c in ",}"):
                self.args_end = j
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = j + 1
                    self.scanned = j + 1
                    return
        self.scanned = len(self.text)

    def new_args(self) -> str:
        """Arguments text not sent yet (trailing whitespace held back until the end is known)."""
        if self.args_start is None:
            return ""
        done = self.args_end is not None
        body = self.text[self.args_start:self.args_end if done else self.scanned]
        body = body.strip() if done else body.lstrip().rstrip()
        new = body[self.args_sent:]
        self.args_sent = len(body)
        return new

    def parsed(self) -> Optional[tuple[str, str]]:
        """(name, arguments JSON) of a complete object whose name did not come first."""
        try:
            obj = json.loads(self.text[:self.end])
        except (ValueError, RecursionError):
            return None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
            return None
        return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class ToolCallParser:
    def __init__(self, fmt: str = "hermes"):
        if fmt not in ("hermes", "llama3_json"):
            raise ValueError(f"tool call parser: one of {', '.join(PARSERS)}; got {fmt!r}")
        self.fmt = fmt
        self.buffer = ""  # text not handled yet
        self.call: Optional[_CallObject] = None  # the call being read
        self.awaiting_close = False  # hermes: a call ended, its closing tag not seen yet
        self.content_only = False  # llama3_json: the output is not calls
        self.tool_calls: list[dict] = []  # OpenAI tool_calls so far (the last one may be growing)
        self._events: list[tuple] = []

    def feed(self, text: str) -> list[tuple]:
        self.buffer += text
        while self._step():
            pass
        events, self._events = self._events, []
        return events

    def finish(self) -> list[tuple]:
        """The end of the output: what was held back is content, unless it is part of a call."""
        if self.call is not None and self.call.name is None:
            self._content(self._opening() + self.call.text)
        elif self.call is None and not self.awaiting_close:
            self._content(self.buffer)
        self.buffer, self.call = "", None
        events, self._events = self._events, []
        return events

    # -- the state machine: each step returns True when it may go on ---------------------------------
    def _step(self) -> bool:
        if self.awaiting_close:
            close = self.buffer.find(HERMES_CLOSE)
            if close < 0:
                return False
            self.awaiting_close, self.buffer = False, self.buffer[close + len(HERMES_CLOSE):]
            return True
        if self.call is not None:
            return self._in_call()
        if self.content_only:
            self._content(self.buffer)
            self.buffer = ""
            return False
        if self.fmt == "hermes":
            at = self.buffer.find(HERMES_OPEN)
            if at < 0:  # hold back what may be the start of the tag
                keep = held_back(self.buffer, HERMES_OPEN)
                self._content(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return False
            self._content(self.buffer[:at])
            self.buffer = self.buffer[at + len(HERMES_OPEN):]
        else:
            stripped = self.buffer.lstrip().lstrip(";").lstrip()
            if not stripped:
                return False
            if not stripped.startswith("{"):
                self.content_only = True
                if self.tool_calls:  # text after the calls
                    self.buffer = stripped
                return True
            self.buffer = stripped
        self.call = _CallObject()
        return True

    def _in_call(self) -> bool:
        call = self.call
        if not call.text:
            stripped = self.buffer.lstrip()
            if not stripped:
                return False
            if not stripped.startswith("{"):  # not a call after all: the tag is content
                return self._not_a_call("")
            self.buffer = stripped
        call.feed(self.buffer)
        self.buffer = ""
        if call.name is not None:
            if not self.tool_calls or self.tool_calls[-1]["_object"] is not call:
                self._start(call, call.name)
            self._args(call.new_args())
        if call.end is None:
            return False
        self.buffer = call.text[call.end:]
        if call.name is None:
            parsed = call.parsed()
            if parsed is None:
                return self._not_a_call(call.text[:call.end])
            self._start(call, parsed[0])
            self._args(parsed[1])
        self.call = None
        self.awaiting_close = self.fmt == "hermes"
        return True

    def _start(self, call: _CallObject, name: str) -> None:
        self.tool_calls.append({"_object": call, "id": new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}})
        self._events.append(("call", len(self.tool_calls) - 1, self.tool_calls[-1]["id"], name))

    def _args(self, text: str) -> None:
        if text:
            self.tool_calls[-1]["function"]["arguments"] += text
            self._events.append(("args", len(self.tool_calls) - 1, text))

    def _not_a_call(self, text: str) -> bool:
        """What opened like a call is not one: it is content, the opening tag included."""
        self._content(self._opening() + text)
        self.call = None
        self.content_only = self.fmt == "llama3_json"
        return True

    def _opening(self) -> str:
        return HERMES_OPEN if self.fmt == "hermes" else ""

    def _content(self, text: str) -> None:
        if text and (text.strip() or not self.tool_calls):  # not the blank lines between calls
            self._events.append(("content", text))


def make_parser(fmt: str, schemas: Optional[dict[str, Any]] = None):
    """The incremental parser of format `fmt`; `schemas` (function name -> its parameters schema)
    type the values of formats that write them as text (qwen3_coder)."""
    if fmt in FORMATS:
        return FORMATS[fmt](schemas)
    if fmt not in PARSERS:
        raise ValueError(f"tool call parser: one of {', '.join(PARSERS)}; got {fmt!r}")
    return ToolCallParser(fmt)


def parse_tool_calls(text: str, fmt: str, schemas: Optional[dict[str, Any]] = None) -> tuple[Optional[str], list[dict]]:
    """A whole answer -> (its content, None when empty; its OpenAI tool_calls)."""
    parser = make_parser(fmt, schemas)
    events = parser.feed(text) + parser.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return (content if content.strip() else None), openai_calls(parser.tool_calls)


def openai_calls(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if not k.startswith("_")} for c in calls]


def delta_calls(events: list[tuple], most: Optional[int] = None) -> list[dict]:
    """A parser's call events as a stream delta's OpenAI `tool_calls` (the first `most` calls)."""
    calls: list[dict] = []
    for event in events:
        if event[0] == "content" or (most is not None and event[1] >= most):
            continue
        if event[0] == "call":
            calls.append({"index": event[1], "id": event[2], "type": "function",
                          "function": {"name": event[3], "arguments": ""}})
        elif calls and calls[-1]["index"] == event[1]:
            calls[-1]["function"]["arguments"] += event[2]
        else:
            calls.append({"index": event[1], "function": {"arguments": event[2]}})
    return calls
