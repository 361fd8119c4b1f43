"""The tool-call formats read by re-reading the whole output: `qwen3_coder`, `deepseek_v3` (and
`mistral`, tool_mistral.py; `pythonic`, tool_pythonic.py), with vLLM's names.

- `qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>…</function>\\n</tool_call>`;
  each value, without the whitespace around it (as xgrammar's qwen_xml reads it), is read by its
  parameter's type in the tool's schema (a string unless the schema says otherwise), the arguments
  sent parameter by parameter;
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{…}\\n```
  <｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`, the arguments streamed as written;

`SnapshotParser` gives them ToolCallParser's interface (feed / finish / tool_calls, the same events):
each feed reads the whole text again as far as it is settled, and sends what was not sent yet.
What it reads never shrinks as text arrives (held back: a partial tag, a call whose end is not
seen), so the streamed pieces always join to the whole answer. A call whose name was sent stays a
call; a block that never makes one is content, its tags included.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from openai_server.reasoning import held_back

ARGS_STRIP = " \t\r\n"


def new_call_id() -> str:
    import uuid
    return f"call_{uuid.uuid4().hex[:24]}"


class BracketScan:
    """Where a bracketed value (JSON's, or Python's with `'` strings too) that opens at `start`
    closes, read as far as the text goes and continued from there when more arrives (the text only
    grows, so a stream is read once, not once per piece). `elements`: the index after each of its
    elements that closed (depth back to 1)."""

    def __init__(self, start: int, quotes: str):
        self.pos, self.quotes = start, quotes
        self.depth, self.quote, self.escaped = 0, "", False
        self.end: Optional[int] = None
        self.elements: list[int] = []

    def read(self, text: str) -> Optional[int]:
        j = self.pos
        while self.end is None and j < len(text):
            c = text[j]
            j += 1
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == self.quote:
                    self.quote = ""
            elif c in self.quotes:
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.end = j
                elif self.depth == 1:
                    self.elements.append(j)
        self.pos = j
        return self.end


def blocks(text: str, open_tag: str, close_tag: str, final: bool):
    """The text cut at `open_tag … close_tag` blocks: ("text", s) and ("block", inner, closed)
    items; a text that may end in a piece of `open_tag` holds it back unless `final`."""
    at = 0
    while True:
        start = text.find(open_tag, at)
        if start < 0:
            rest = text[at:]
            keep = 0 if final else held_back(rest, open_tag)
            yield "text", rest[:len(rest) - keep]
            return
        yield "text", text[at:start]
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            yield "block", text[start + len(open_tag):], False
            return
        yield "block", text[start + len(open_tag):end], True
        at = end + len(close_tag)


class SnapshotParser:
    """A format's `scan(text, final)` -> items in order: ("text", s), or ("call", name, args) where
    the last call's args may still grow. Subclasses write scan."""

    def __init__(self, schemas: Optional[dict[str, dict]] = None):
        self.schemas = schemas or {}  # function name -> its parameters schema
        self.text = ""
        self.sent_content = ""
        self.tool_calls: list[dict] = []
        self._scans: dict[tuple[int, str], BracketScan] = {}

    def scan(self, text: str, final: bool) -> list[tuple]:
        raise NotImplementedError

    def bracket(self, tail: str, at: int = 0, quotes: str = '"') -> BracketScan:
        """The scan of the value opening at index `at` of `tail`, an end of this parser's text (so
        its place in the text is fixed), read up to the text's end; its indices are `tail`'s."""
        offset = len(self.text) - len(tail)
        scan = self._scans.get((offset + at, quotes))
        if scan is None:
            scan = self._scans[(offset + at, quotes)] = BracketScan(offset + at, quotes)
        scan.read(self.text)
        return _Relative(scan, offset)

    def feed(self, text: str) -> list[tuple]:
        self.text += text
        return self._events(final=False)

    def finish(self) -> list[tuple]:
        return self._events(final=True)

    def _events(self, final: bool) -> list[tuple]:
        content, calls, seen_call = [], [], False
        for item in self.scan(self.text, final):
            if item[0] == "call":
                calls.append(item[1:])
                seen_call = True
            elif item[1] and (item[1].strip() or not seen_call):  # not the blank lines between calls
                content.append(item[1])
        content = "".join(content)
        events: list[tuple] = []
        if len(content) > len(self.sent_content):
            events.append(("content", content[len(self.sent_content):]))
            self.sent_content = content
        for i, (name, args) in enumerate(calls):
            if i == len(self.tool_calls):
                self.tool_calls.append({"id": new_call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}})
                events.append(("call", i, self.tool_calls[i]["id"], name))
            sent = self.tool_calls[i]["function"]["arguments"]
            if len(args) > len(sent):
                events.append(("args", i, args[len(sent):]))
                self.tool_calls[i]["function"]["arguments"] = args
        return events


class _Relative:
    """A BracketScan's indices, as seen from an end of the text that starts at `offset`."""

    def __init__(self, scan: BracketScan, offset: int):
        self.end = None if scan.end is None else scan.end - offset
        self.elements = [e - offset for e in scan.elements]


# -- qwen3_coder --------------------------------------------------------------------------------------
QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def typed_value(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as its schema's type (a string when the schema says so or
    says nothing; what does not read as the type stays the text)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds <= {None, "string"} and not (isinstance(schema, dict) and "enum" in schema
                                          and any(not isinstance(e, str) for e in schema["enum"])):
        return value
    if value.strip() == "null" and "null" in kinds:
        return None
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):  # a value nested past what json reads is text
        return value
    if "string" in kinds and not isinstance(parsed, str) and not kinds & {"integer", "number", "boolean",
                                                                         "object", "array", "null"}:
        return value
    return parsed


class Qwen3CoderParser(SnapshotParser):
    def scan(self, text: str, final: bool) -> list[tuple]:
        items: list[tuple] = []
        for item in blocks(text, QWEN_OPEN, QWEN_CLOSE, final):
            if item[0] == "text":
                items.append(item)
                continue
            inner, closed = item[1], item[2]
            head = _FUNCTION.match(inner)
            if head is None:
                if closed or final:
                    items.append(("text", QWEN_OPEN + inner + (QWEN_CLOSE if closed else "")))
                if not closed:
                    break
                continue
            name = head.group(1).strip()
            body = inner[head.end():]
            done = closed or final or "</function>" in body
            body = body.split("</function>", 1)[0]
            props = (self.schemas.get(name) or {}).get("properties") or {}
            pairs = []
            for m in _PARAMETER.finditer(body):
                key, value = m.group(1).strip(), m.group(2).strip()  # the grammar's reading (qwen_xml)
                pairs.append(f"{json.dumps(key, ensure_ascii=False)}: "
                             f"{json.dumps(typed_value(value, props.get(key)), ensure_ascii=False)}")
            items.append(("call", name, "{" + ", ".join(pairs) + ("}" if done else "")))
            if not closed:
                break
        return items


# -- deepseek_v3 --------------------------------------------------------------------------------------
DS_CALLS_OPEN, DS_CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_OPEN, DS_CALL_CLOSE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_FENCE = "```"


class DeepSeekV3Parser(SnapshotParser):
    def scan(self, text: str, final: bool) -> list[tuple]:
        items: list[tuple] = []
        for item in blocks(text, DS_CALLS_OPEN, DS_CALLS_CLOSE, final):
            if item[0] == "text":
                items.append(item)
                continue
            section, closed = item[1], item[2]
            calls = self._calls(section, closed or final)
            if not calls and (closed or final):  # nothing in it reads as a call: it is text
                items.append(("text", DS_CALLS_OPEN + section + (DS_CALLS_CLOSE if closed else "")))
            items.extend(calls)
            if not closed:
                break
        return items

    def _calls(self, section: str, done: bool) -> list[tuple]:
        out = []
        for item in blocks(section, DS_CALL_OPEN, DS_CALL_CLOSE, done):
            if item[0] != "block":
                continue
            inner, closed = item[1], item[2] or done
            sep = inner.find(DS_SEP)
            if sep < 0:
                continue
            after = inner[sep + len(DS_SEP):]
            line = after.find("\n")
            if line < 0:
                if closed:
                    out.append(("call", after.strip(), "{}"))
                break
            name, body = after[:line].strip(), after[line + 1:]
            if body.startswith(DS_FENCE):  # ```json\n
                newline = body.find("\n")
                body = body[newline + 1:] if newline >= 0 else ""
            elif not closed and DS_FENCE.startswith(body):
                body = ""
            if not closed:
                body = body[:len(body) - held_back(body, DS_CALL_CLOSE)]
            out.append(("call", name, body.rstrip(ARGS_STRIP + "`")))
            if not item[2]:
                break
        return out
