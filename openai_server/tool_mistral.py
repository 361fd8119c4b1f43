"""The `mistral` tool-call format (vLLM's name): `[TOOL_CALLS]` then a JSON list of {"name",
"arguments"} objects (Mistral 7B v0.3's; each call sent once its object is whole; an object cut
short by max_tokens after whole calls is dropped), or the newer `[TOOL_CALLS]NAME[ARGS]{…}`, again
for each call (Mistral Small 3.2, Devstral; the arguments streamed as written, a `[CALL_ID]` before
`[ARGS]` skipped). Text before `[TOOL_CALLS]` is content; what follows it and is not calls is
content too, the tag included. `[TOOL_CALLS]` is a control token of Mistral's tokenizers: the text
has it only when special tokens are kept in the output (`skip_special_tokens: false`), as with vLLM.
"""
from __future__ import annotations

import json
import re

from openai_server.reasoning import held_back
from openai_server.tool_formats import ARGS_STRIP, SnapshotParser

MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class MistralParser(SnapshotParser):
    def scan(self, text: str, final: bool) -> list[tuple]:
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            keep = 0 if final else held_back(text, MISTRAL_CALLS)
            return [("text", text[:len(text) - keep])]
        items: list[tuple] = [("text", text[:start])]
        rest = text[start + len(MISTRAL_CALLS):]
        if not rest.strip() and not final:
            return items  # a JSON list or a name: not known yet
        if rest.lstrip().startswith("["):
            return items + self._json_list(rest, final)
        return items + self._tagged(rest, final)

    def _json_list(self, rest: str, final: bool) -> list[tuple]:
        """[{"name": ..., "arguments": {...}}, ...]: each call once its object is whole."""
        at = rest.index("[") + 1
        items: list[tuple] = []
        while True:
            while at < len(rest) and rest[at] in ARGS_STRIP + ",":
                at += 1
            if at < len(rest) and rest[at] == "]":
                return items + [("text", rest[at + 1:])]
            end = self.bracket(rest, at).end if at < len(rest) and rest[at] == "{" else None
            if end is None:  # at the end, an object cut short after whole calls is dropped
                if (final and not items) or (at < len(rest) and rest[at] != "{"):
                    items.append(("text", MISTRAL_CALLS + rest if not items else rest[at:]))
                return items
            try:
                obj = json.loads(rest[at:end])
            except (ValueError, RecursionError):
                obj = None
            args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
                return items + [("text", MISTRAL_CALLS + rest if not items else rest[at:])]
            items.append(("call", obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
            at = end

    def _tagged(self, rest: str, final: bool) -> list[tuple]:
        """NAME[ARGS]{...}, again after each [TOOL_CALLS]: the arguments streamed as written."""
        items: list[tuple] = []
        while True:
            raw, rest = rest, rest.lstrip()
            name = _MISTRAL_NAME.match(rest).group(0)
            after = rest[len(name):]
            if after.startswith(MISTRAL_CALL_ID):  # [CALL_ID]id before [ARGS]: the id is ours to make
                args_at = after.find(MISTRAL_ARGS)
                after = after[args_at:] if args_at >= 0 else ("" if not final else after)
            if not after.startswith(MISTRAL_ARGS):
                if not final and (MISTRAL_ARGS.startswith(after) or after.startswith(MISTRAL_CALL_ID)):
                    return items  # the name or its [ARGS] still coming
                return items + [("text", MISTRAL_CALLS + raw)]
            body = after[len(MISTRAL_ARGS):]
            stripped = body.lstrip()
            end = self.bracket(stripped).end if stripped.startswith(("{", "[")) else None
            if end is None:
                if stripped and not stripped.startswith(("{", "[")):
                    return items + [("text", MISTRAL_CALLS + raw)]
                return items + [("call", name, stripped.rstrip(ARGS_STRIP))]
            items.append(("call", name, stripped[:end]))
            tail = stripped[end:]
            nxt = tail.lstrip()
            if nxt.startswith(MISTRAL_CALLS):
                rest = nxt[len(MISTRAL_CALLS):]
                continue
            keep = 0 if final else held_back(tail, MISTRAL_CALLS)
            if not final and nxt and MISTRAL_CALLS.startswith(nxt):
                return items
            return items + [("text", tail[:len(tail) - keep])]
