"""OpenAI tool calling on /v1/chat/completions: the request side.

- `tools` (function tools), `tool_choice` ("none", "auto", "required", or a named function) and
  `parallel_tool_calls` are checked here (an unknown tool name is a 400 naming `tool_choice`).
- The tools reach the prompt through the checkpoint's own chat template, as its `tools` variable
  (transformers' convention). A template that never reads `tools` (SmolLM2's) gets the default:
  the tools and the call format are described in the system message (`tools_in_system_message`),
  assistant tool calls are written back in that format and `tool` results are handed back in a
  user turn, in `<tool_response>` tags.
- "required" and a named function are enforced: the output must be tool calls in the server's
  format (`--tool-call-parser`), each call's arguments following its function's JSON schema. That
  is an xgrammar structural tag sent as `structured_outputs` (backend/structured/), the same path as
  every other constraint. "auto" is not constrained: calls are parsed out of the text
  (tool_parsers.py). "none" renders the tools (as vLLM) and parses nothing.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from backend.core.schema_check import check_schema
from openai_server.constraints import FieldError
from openai_server.tool_grammar import calls_text, structural_tag
from openai_server.tool_parsers import PARSERS

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128


@dataclass
class ToolCalling:
    functions: list[dict[str, Any]]  # OpenAI's function objects: name, description, parameters
    choice: str  # "none" | "auto" | "required" | a function's name
    parallel: bool
    parser: str  # the output format: tool_parsers.PARSERS

    @property
    def named(self) -> bool:
        return self.choice not in ("none", "auto", "required")

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def enforced(self) -> list[dict[str, Any]]:
        """The functions whose calls the output must follow ("required": all; a named one: it)."""
        if self.choice in ("none", "auto"):
            return []
        return [f for f in self.functions if not self.named or f["name"] == self.choice]

    @property
    def loose(self) -> bool:
        """An enforced function marked "strict": false: its schema's unenforceable keywords pass."""
        return any(f.get("strict") is False for f in self.enforced)

    def check_schemas(self) -> None:
        """Every function's parameters must be a valid, satisfiable JSON schema, whatever tool_choice
        says (a model told of an impossible schema cannot call the function right); an enforced
        one's keywords must also be ones the grammar enforces, unless the function is not strict."""
        enforced = {f["name"] for f in self.enforced}
        for i, f in enumerate(self.functions):
            where = f"tools[{i}].function.parameters"
            try:
                check_schema(f.get("parameters") or {"type": "object"}, where, enforced=f["name"] in enforced,
                             allow_unenforced=f.get("strict") is False)
            except ValueError as exc:
                raise FieldError("tools", str(exc)) from None

    # -- the request ---------------------------------------------------------------------------------
    @classmethod
    def from_body(cls, body: dict[str, Any], parser: str) -> Optional["ToolCalling"]:
        tools, choice = body.get("tools"), body.get("tool_choice")
        parallel = body.get("parallel_tool_calls")
        if not tools:
            if choice not in (None, "none"):
                raise FieldError("tool_choice", "tool_choice needs tools")
            return None
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise FieldError("tools", f"tools must be a list of at most {MAX_TOOLS} function tools")
        functions = [_function(i, t) for i, t in enumerate(tools)]
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tools: function names must be unique")
        if parallel is not None and not isinstance(parallel, bool):
            raise FieldError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
        if parser not in PARSERS:
            raise FieldError("tools", f"the server's --tool-call-parser must be one of {', '.join(PARSERS)}")
        calling = cls(functions, _choice(choice, names), True if parallel is None else parallel, parser)
        calling.check_schemas()
        return calling

    def template_tools(self) -> list[dict[str, Any]]:
        """The `tools` variable of a chat template: [{"type": "function", "function": {...}}]."""
        return [{"type": "function", "function": f} for f in self.functions]

    def structural_tag(self) -> Optional[dict[str, Any]]:
        """The constraint of "required" / a named function: tool calls in the server's format, each
        call's arguments by its function's schema (xgrammar's structural-tag JSON)."""
        chosen = self.enforced
        if not chosen:
            return None
        return structural_tag(self.parser, chosen, self.named, self.parallel)

    # -- the prompt of a template without tools ------------------------------------------------------
    def tools_in_system_message(self, messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
        """The default for a template that has no tools section: the tools and the call format in
        the system message; earlier calls and their results as text the template can show."""
        out = [_plain_turn(m, self.parser) for m in messages]
        prompt = self.system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        return out

    def system_prompt(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = calls_text(self.parser, [("function name", {"argument": "value"})])
        if self.parser == "hermes":  # the wording the default model was tested with
            how = ("To call a function, answer with its name and arguments as a JSON object inside "
                   f"<tool_call></tool_call> tags, one call per tag:\n{example}")
        elif self.parser == "llama3_json":
            how = ('To call a function, answer only with a JSON object of its name and parameters, '
                   f'several separated by ";":\n{example}')
        else:
            how = f"To call a function, answer with the call written exactly so (several calls allowed):\n{example}"
        return (f"You can call these functions (JSON schemas):\n<tools>\n{listed}\n</tools>\n\n{how}\n"
                "A function's result comes back in <tool_response></tool_response> tags.")


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates with tools: an assistant call's `arguments` as an object, as transformers'
    templates read it (OpenAI sends the JSON text)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if m.get("role") == "tool" and not isinstance(m.get("content"), str):
            raise FieldError("messages", f"messages[{i}]: a tool message needs its result as content")
        calls = m.get("tool_calls")
        if calls is not None and (m.get("role") != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise FieldError("messages", f"messages[{i}].tool_calls: a list of {{id, type, function: {{name, "
                                        "arguments}}}} on an assistant message")


def _function(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise FieldError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
    f = tool["function"]
    if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
        raise FieldError("tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ or -")
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise FieldError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
    return {k: v for k, v in f.items() if k in ("name", "description", "parameters", "strict") and v is not None}


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise FieldError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise FieldError("tool_choice", f"tool_choice names the function '{name}', which is not among the tools "
                                       f"({', '.join(names)})")
    return name


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            pass
    return {**call, "function": function}


def _plain_turn(message: dict[str, Any], parser: str) -> dict[str, Any]:
    """A turn of the tools conversation as plain text (a template without tools)."""
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    text = calls_text(parser, [(c["function"].get("name", ""), c["function"].get("arguments", {}))
                               for c in (_with_object_arguments(c) for c in calls)])
    content = message.get("content") or ""
    return {"role": "assistant", "content": f"{content}\n{text}" if content else text}
