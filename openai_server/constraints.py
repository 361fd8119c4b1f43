"""What an OpenAI request asks its output to follow -> the engine's `structured_outputs` (vLLM's
StructuredOutputsParams, backend/core/structured.py), sent in sampling_parameters.

Three ways to ask, at most one per request:
- OpenAI's `response_format`: {"type": "json_object"}, or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} (the schema is always enforced, as vLLM does; keywords xgrammar
  cannot enforce are refused, or accepted unenforced when `strict` is false);
- vLLM's extra fields: `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | ...}) and
  the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, ...;
- `tool_choice` "required" or a named function (tools.py): a structural tag over the call format.
With a reasoning parser (`--reasoning-parser`), the constraint holds for the answer only: the
output is a think block (`<think>` unless the prompt opened it, free text, `</think>`), then the
constraint (`answer_only`), as one xgrammar structural tag. The same think block carries a thinking
budget (vLLM's `thinking_token_budget`): past that many tokens of thinking the grammar lets only
`</think>` come, so it is forced, on the engine's structured path. A prompt that closed the thinking
(Qwen3's `enable_thinking: false`) leaves the constraint as it was.
The shape is checked here, naming the parameter, and so are schemas (backend/core/schema_check.py);
compiling (a grammar xgrammar refuses, one no token can start) is the engine's, off the request
path: its 400 names `structured_outputs.<kind>`.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Optional

from backend.core.structured import FIELD, KINDS, LEGACY_KEYS, StructuredOutputs, fold_legacy_keys
from openai_server.reasoning import THINK_CLOSE, THINK_OPEN

if TYPE_CHECKING:
    from openai_server.tools import ToolCalling

# vLLM's extra OpenAI fields that set a constraint.
EXTRA_FIELDS = (FIELD,) + tuple(LEGACY_KEYS)
FIELDS = ("response_format",) + EXTRA_FIELDS


class FieldError(ValueError):
    """A bad value of one OpenAI parameter (`param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message if message.startswith(param) else f"{param}: {message}")
        self.param = param


def structured_outputs(body: dict[str, Any], tools: Optional["ToolCalling"] = None) -> Optional[dict[str, Any]]:
    """The request's constraint as the engine's JSON object, or None."""
    asked: list[tuple[str, dict[str, Any]]] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        asked.append(("response_format", response_format))
    extras = {k: body[k] for k in EXTRA_FIELDS if body.get(k) is not None}
    if extras:
        param = sorted(extras)[0]
        try:
            spec = fold_legacy_keys(extras)[FIELD]
        except ValueError as exc:
            raise FieldError(param, str(exc)) from None
        asked.append((param, as_json(spec)))
    tag = tools.structural_tag() if tools is not None else None
    if tag is not None:  # a tool marked "strict": false accepts keywords xgrammar cannot enforce
        asked.append(("tool_choice", {"structural_tag": tag, **({"allow_unenforced_keywords": True}
                                                                 if tools.loose else {})}))
    if len(asked) > 1:
        raise FieldError(asked[1][0], f"one output constraint per request: {' and '.join(a for a, _ in asked)} "
                                      "both ask for one")
    if not asked:
        return None
    param, spec = asked[0]
    try:
        StructuredOutputs.parse(spec)
    except ValueError as exc:
        raise FieldError(param, str(exc)) from None
    return spec


def answer_only(spec: Optional[dict[str, Any]], param: str, reasoning_parser: Optional[str], prompt: str,
                budget: Optional[int]) -> Optional[dict[str, Any]]:
    """The constraint `spec` (None: none) moved after the thinking, with the thinking budget."""
    if reasoning_parser is None or prompt == "closed" or (spec is None and budget is None):
        return spec
    begin = "" if prompt == "open" or reasoning_parser == "deepseek_r1" else THINK_OPEN
    content: dict[str, Any] = {"type": "any_text", **({"max_tokens": budget} if budget is not None else {})}
    think = {"type": "tag", "begin": begin, "content": content, "end": THINK_CLOSE}
    newlines = {"type": "regex", "pattern": "\\n{0,2}"}  # what a model writes after </think>
    answer, flags = ({"type": "any_text"}, {}) if spec is None else _as_format(spec, param)
    return {"structural_tag": {"type": "structural_tag", "format": {"type": "sequence",
                                                                    "elements": [think, newlines, answer]}}, **flags}


def _as_format(spec: dict[str, Any], param: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A constraint as a structural tag's format (and the flags kept beside it)."""
    flags = {k: v for k, v in spec.items() if k not in KINDS}
    if "json" in spec or "json_object" in spec:
        schema = spec["json"] if "json" in spec else {"type": "object"}
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return {"type": "json_schema", "json_schema": schema}, flags
    if "regex" in spec:
        return {"type": "regex", "pattern": spec["regex"]}, flags
    if "choice" in spec:
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in spec["choice"]]}, flags
    if "grammar" in spec:
        if "::=" not in spec["grammar"]:
            raise FieldError(param, f"{param}: with a reasoning parser a grammar must be EBNF (a Lark grammar "
                                    "cannot follow the thinking)")
        return {"type": "grammar", "grammar": spec["grammar"]}, flags
    tag = spec["structural_tag"]
    tag = json.loads(tag) if isinstance(tag, str) else tag
    if not isinstance(tag, dict) or "format" not in tag:
        raise FieldError(param, f"{param}: with a reasoning parser a structural tag must be "
                                '{"type": "structural_tag", "format": ...}')
    return tag["format"], flags


def as_json(spec: StructuredOutputs) -> dict[str, Any]:
    """A StructuredOutputs as the JSON object of its set fields."""
    out = {spec.kind: list(spec.choice) if spec.kind == "choice" else getattr(spec, spec.kind)}
    for name in ("disable_any_whitespace", "disable_additional_properties", "allow_unenforced_keywords"):
        if getattr(spec, name):
            out[name] = True
    return out


def _response_format(value: Any) -> Optional[dict[str, Any]]:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise FieldError("response_format", 'response_format.json_schema must be {"name", "schema", "strict"}')
        schema = spec.get("schema")
        if schema is None:  # OpenAI's schema is optional: then any object
            return {"json_object": True}
        if not isinstance(schema, (dict, bool)):
            raise FieldError("response_format", "response_format.json_schema.schema must be a JSON schema object")
        if spec.get("strict") not in (None, True, False):
            raise FieldError("response_format", "response_format.json_schema.strict must be a boolean")
        # strict false (asked for, not left out): keywords xgrammar cannot enforce are accepted unenforced
        return {"json": schema, **({"allow_unenforced_keywords": True} if spec.get("strict") is False else {})}
    raise FieldError("response_format", f'response_format.type must be "text", "json_object" or "json_schema"; '
                                        f"got {kind!r}")


__all__ = ["FIELDS", "FieldError", "structured_outputs", "answer_only", "as_json", "KINDS"]
