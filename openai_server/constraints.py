"""What an OpenAI request asks its output to follow -> the engine's `structured_outputs` (vLLM's
StructuredOutputsParams, backend/core/structured.py), sent in sampling_parameters.

Three ways to ask, at most one per request:
- OpenAI's `response_format`: {"type": "json_object"}, or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}} (the schema is always enforced, as vLLM does; keywords xgrammar
  cannot enforce are refused, or accepted unenforced when `strict` is false);
- vLLM's extra fields: `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | ...}) and
  the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, ...;
- `tool_choice` "required" or a named function (tools.py): a structural tag over the call format.
The shape is checked here, naming the parameter, and so are schemas (backend/core/schema_check.py);
compiling (a grammar xgrammar refuses, one no token can start) is the engine's, off the request
path: its 400 names `structured_outputs.<kind>`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from backend.core.structured import FIELD, KINDS, LEGACY_KEYS, StructuredOutputs, fold_legacy_keys

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


__all__ = ["FIELDS", "FieldError", "structured_outputs", "as_json", "KINDS"]
