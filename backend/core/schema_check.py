"""JSON schemas checked at arrival, before any compile: what would be refused later, or honoured only
in part, is refused now with the place in the schema (a JSON pointer). No torch, no xgrammar: the
Triton adapter and the OpenAI server run it on the request's own thread, in microseconds.

Three kinds of refusal, each a ValueError naming the field:
- too large to compile in reasonable time: nested deeper than `MAX_SCHEMA_DEPTH` subschemas (xgrammar's
  grammar grows quadratically with depth: 800 levels compiled for 85 s), or values nested deeper
  than `MAX_JSON_DEPTH` JSON levels;
- invalid or unsatisfiable: a keyword whose value has the wrong type, an unknown type name, bounds
  that exclude every value (minLength above maxLength, an integer range with no integer, an enum
  none of whose values has the declared type), a required property the object cannot have, a
  schema with no finite instance (a required recursion with no base case: backend/core/schema_finite.py);
- not enforced: keywords xgrammar 0.2.8 accepts and ignores (`UNENFORCED`, checked against it by
  tests/test_schema_checks.py), so a "guaranteed" output could break them. These are listed in one
  message; a request may accept them unenforced (`allow_unenforced_keywords`, OpenAI's
  `"strict": false`), as vLLM's xgrammar backend would.
`oneOf` is enforced as `anyOf` (an output matching two branches passes) and is not refused.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

from backend.core.schema_finite import check_finite

MAX_SCHEMA_DEPTH = 32  # subschemas within subschemas (OpenAI's structured outputs allow 10)
MAX_JSON_DEPTH = 128  # JSON nesting of the whole value, annotations and enums included
TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
# string formats xgrammar 0.2.8 enforces (others pass any string)
FORMATS = ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
# keywords without effect on what is valid, allowed beside $ref
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "$anchor", "$defs", "definitions"})
# keyword -> why xgrammar 0.2.8 cannot enforce it (besides the conditional ones in _unenforced)
UNENFORCED = {"uniqueItems": "items are not checked for uniqueness", "contains": "not enforced",
              "minContains": "not enforced", "maxContains": "not enforced", "not": "not enforced",
              "if": "conditionals are not enforced", "then": "conditionals are not enforced",
              "else": "conditionals are not enforced", "dependentRequired": "not enforced",
              "dependentSchemas": "not enforced", "dependencies": "not enforced",
              "$dynamicRef": "dynamic references are not resolved", "$recursiveRef": "recursive references are not resolved"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMAS = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
            "not", "if", "then", "else", "contains", "propertyNames", "contentSchema")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def check_schema(schema: Any, where: str, enforced: bool = True, allow_unenforced: bool = False) -> None:
    """Raise ValueError naming `where` and the pointer for the first problem, or listing every
    unenforced keyword. `enforced`: the schema becomes a grammar (objects closed, as vLLM's strict
    xgrammar mode); else it is only described to the model (tools with tool_choice auto)."""
    check_json_depth(schema, where)
    skipped: list[str] = []
    nodes: list[tuple[Any, str]] = []
    for node, pointer in _subschemas(schema, where):
        nodes.append((node, pointer))
        if isinstance(node, bool):
            continue
        _check_values(node, where, pointer)
        _check_satisfiable(node, where, pointer)
        _check_ref(node, schema, where, pointer)
        if enforced:
            skipped += [f"{key} at {pointer or '/'}" for key in _unenforced(node)]
    if schema is False:
        raise ValueError(f"{where}: the schema is false: no output can satisfy it")
    if enforced:
        check_finite(schema, where, nodes, lambda ref: _resolve(ref, schema))
    if skipped and not allow_unenforced:
        raise ValueError(f"{where}: xgrammar cannot enforce these JSON-schema keywords, so the output could break "
                         f"them: {', '.join(skipped)}; remove them, or accept them unenforced with "
                         "allow_unenforced_keywords=true (OpenAI: response_format.json_schema.strict=false)")


def check_json_depth(value: Any, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a value nested deeper than `limit` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise ValueError(f"{where} is nested more than {limit} levels deep (the limit)")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _subschemas(schema: Any, where: str) -> Iterator[tuple[Any, str]]:
    """Every subschema with its JSON pointer, the root first; refuses nesting past MAX_SCHEMA_DEPTH."""
    stack = [(schema, "", 0)]
    while stack:
        node, pointer, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{where}: subschemas are nested more than {MAX_SCHEMA_DEPTH} levels deep (at "
                             f"{pointer}); the limit is {MAX_SCHEMA_DEPTH}: deeper schemas compile for minutes")
        if not isinstance(node, (dict, bool)):
            raise ValueError(f"{where}: {pointer or 'the schema'} must be a JSON schema (an object or a boolean); "
                             f"got {type(node).__name__}")
        yield node, pointer
        if isinstance(node, bool):
            continue
        children = []
        for key in _SCHEMA_MAPS:
            value = node.get(key)
            if value is not None:
                _need(isinstance(value, dict), where, pointer, key, "an object of schemas")
                children += [(v, f"{pointer}/{key}/{_escape(k)}") for k, v in value.items()]
        for key in _SCHEMA_LISTS:
            value = node.get(key)
            if value is not None:
                _need(isinstance(value, list) and (value or key == "prefixItems"), where, pointer, key,
                      "a non-empty list of schemas")
                children += [(v, f"{pointer}/{key}/{i}") for i, v in enumerate(value)]
        for key in _SCHEMAS:
            if key in node:
                if key == "items" and isinstance(node[key], list):
                    raise ValueError(f"{where}: {pointer}/items is a list (draft 4 tuples); use prefixItems")
                children.append((node[key], f"{pointer}/{key}"))
        stack.extend((child, p, depth + 1) for child, p in reversed(children))


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _need(ok: bool, where: str, pointer: str, key: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {pointer}/{key} must be {what}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_values(node: dict, where: str, pointer: str) -> None:
    kind = node.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        _need(bool(kinds) and all(isinstance(k, str) and k in TYPES for k in kinds) and len(set(kinds)) == len(kinds),
              where, pointer, "type", f"one of {', '.join(TYPES)} or a non-empty list of them; got {kind!r}")
    if "required" in node:
        req = node["required"]
        _need(isinstance(req, list) and all(isinstance(r, str) for r in req), where, pointer, "required",
              "a list of property names")
    if "enum" in node:
        _need(isinstance(node["enum"], list) and bool(node["enum"]), where, pointer, "enum", "a non-empty list")
    for key in _COUNTS:
        if key in node:
            v = node[key]
            _need(_is_number(v) and v >= 0 and float(v).is_integer(), where, pointer, key,
                  f"a non-negative integer; got {v!r}")
    for key in _NUMBERS:
        if key in node and not (key.startswith("exclusive") and isinstance(node[key], bool)):
            _need(_is_number(node[key]), where, pointer, key, f"a finite number; got {node[key]!r}")
    if "multipleOf" in node:
        _need(node["multipleOf"] > 0, where, pointer, "multipleOf", "greater than 0")
    for key in ("pattern", "format", "$ref"):
        if key in node:
            _need(isinstance(node[key], str), where, pointer, key, "a string")


def _types_of(value: Any) -> set[str]:
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return {str: {"string"}, dict: {"object"}, list: {"array"}, type(None): {"null"}}.get(type(value), set())


def _check_satisfiable(node: dict, where: str, pointer: str) -> None:
    def refuse(why: str) -> None:
        raise ValueError(f"{where}: {pointer or 'the schema'} can never be satisfied: {why}")

    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
                      ("minContains", "maxContains")):
        if low in node and high in node and node[low] > node[high]:
            refuse(f"{low} {node[low]} is greater than {high} {node[high]}")
    lows = [(node[k], k) for k in ("minimum", "exclusiveMinimum") if _is_number(node.get(k))]
    highs = [(node[k], k) for k in ("maximum", "exclusiveMaximum") if _is_number(node.get(k))]
    for lo, lo_key in lows:
        for hi, hi_key in highs:
            if lo > hi or (lo == hi and "exclusive" in lo_key + hi_key):
                refuse(f"{lo_key} {lo} and {hi_key} {hi} leave no number")
    kinds = node.get("type")
    kinds = set(kinds if isinstance(kinds, list) else [kinds]) if kinds is not None else None
    if kinds == {"integer"} and lows and highs:
        first = max(math.floor(v) + 1 if "exclusive" in k else math.ceil(v) for v, k in lows)
        last = min(math.ceil(v) - 1 if "exclusive" in k else math.floor(v) for v, k in highs)
        if first > last:
            refuse("no integer lies between its bounds")
    if kinds is not None:
        for key in ("enum", "const"):
            values = (node.get("enum") or []) if key == "enum" else [node[key]] if key in node else []
            if values and not any(_types_of(v) & kinds for v in values):
                refuse(f"no value of its {key} is of type {' or '.join(sorted(kinds))}")
    properties = node.get("properties") or {}
    for name in node.get("required") or []:
        if properties.get(name) is False:
            refuse(f"required property '{name}' has the schema false")
        if name not in properties and node.get("additionalProperties") is False and not node.get("patternProperties"):
            refuse(f"required property '{name}' is not among its properties, and no other property is allowed")


def _missing_required(node: dict) -> list[str]:
    """Required names an enforced (strict) object cannot write: not among its properties, with no
    additionalProperties or patternProperties to allow them (xgrammar then drops the requirement)."""
    if any(k in node for k in ("allOf", "anyOf", "oneOf", "$ref", "patternProperties")) or \
            node.get("additionalProperties") not in (None, False):
        return []
    properties = node.get("properties") or {}
    return [n for n in node.get("required") or [] if n not in properties]


def _unenforced(node: dict) -> list[str]:
    found = [k for k in UNENFORCED if k in node and not (k == "uniqueItems" and node[k] is False)]
    if "multipleOf" in node and not (node.get("type") == "integer" and float(node["multipleOf"]).is_integer()):
        found.append("multipleOf")  # enforced on integers by integers only
    if "format" in node and node["format"] not in FORMATS:
        found.append(f"format '{node['format']}'")
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        found.append("minLength/maxLength beside pattern or format")  # the pattern wins, the lengths are dropped
    found += [f"required '{n}' (not among the properties of a strict object)" for n in _missing_required(node)]
    if len(node.get("allOf") or []) > 1:
        found.append("allOf of several schemas")  # not intersected
    ref = node.get("$ref")
    if isinstance(ref, str):
        if not ref.startswith("#"):
            found.append(f"remote $ref '{ref}'")
        elif set(node) - ANNOTATIONS - {"$ref"}:
            found.append("keywords beside $ref")  # only the reference is followed
    return found


def _check_ref(node: dict, root: Any, where: str, pointer: str) -> None:
    """A local $ref must point at a schema of this document."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#"):
        return
    if _resolve(ref, root) is None:
        raise ValueError(f"{where}: {pointer}/$ref '{ref}' points at nothing in the schema")


def _resolve(ref: str, root: Any) -> Any:
    """A local $ref's target in `root`, or None."""
    if not ref.startswith("#"):
        return None
    target = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target
