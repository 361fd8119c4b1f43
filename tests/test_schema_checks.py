"""backend/core/schema_check.py against xgrammar 0.2.8 itself: every keyword refused as
unenforced has an instance that breaks it and that xgrammar's grammar still accepts (so the
refusal is needed), every keyword let through is one xgrammar enforces; and the checks of
nesting, invalid and unsatisfiable schemas, each naming the place in the schema."""
from __future__ import annotations

import json

import pytest

from backend.core.schema_check import check_schema

I, N, S = {"type": "integer"}, {"type": "number"}, {"type": "string"}
AB = {"type": "object", "properties": {"a": I, "b": I}}

# keyword as the refusal lists it -> (a schema using it, an instance that breaks it)
UNENFORCED = {
    "uniqueItems": ({"type": "array", "items": I, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": I, "contains": {"const": 3}}, "[1]"),
    "maxContains": ({"type": "array", "items": I, "contains": {"const": 3}, "maxContains": 1}, "[3, 3]"),
    "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    "if": ({**AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "else": ({**AB, "if": {"required": ["a"]}, "else": {"required": ["b"]}}, "{}"),
    "dependentRequired": ({**AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({**AB, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "dependencies": ({**AB, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "$dynamicRef": ({"$dynamicRef": "#x", "type": "integer", "$defs": {}}, "1"),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3"),
    "format 'iri'": ({"type": "string", "format": "iri"}, '"%%% not an iri"'),
    "minLength/maxLength beside pattern or format": ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"'),
    "allOf of several schemas": ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, "7"),
    "keywords beside $ref": ({"$defs": {"x": I}, "$ref": "#/$defs/x", "minimum": 3}, "1"),
    "remote $ref": ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}},
                     "required": ["a"]}, '{"a": "anything"}'),
    "required 'b'": ({"type": "object", "properties": {"a": I}, "required": ["b"]}, '{"a": 1}'),
}
# keywords xgrammar enforces: allowed through, an instance that breaks each is refused by the grammar
ENFORCED = [
    ({"type": "string", "minLength": 3}, '"a"'), ({"enum": [1, 2]}, "3"), ({"type": "integer", "multipleOf": 3}, "4"),
    ({"type": "array", "items": I, "minItems": 2}, "[1]"), ({"type": "string", "format": "email"}, '"x"'),
    ({"type": "integer", "exclusiveMaximum": 2}, "2"), ({**AB, "required": ["a"]}, '{"b": 1}'),
    ({"type": "object", "properties": {"a": I}, "minProperties": 1}, "{}"),
    ({"$defs": {"x": I}, "$ref": "#/$defs/x", "description": "annotations beside $ref are fine"}, '"s"'),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, "1"), ({"type": "string", "pattern": "^a+$"}, '"b"'),
]


def accepts(schema, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True, strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("keyword", list(UNENFORCED))
def test_each_refused_keyword_is_one_xgrammar_ignores(keyword):
    schema, breaks_it = UNENFORCED[keyword]
    assert accepts(schema, breaks_it), f"xgrammar enforces {keyword} now: let it through"
    with pytest.raises(ValueError, match=r"^structured_outputs.json: xgrammar cannot enforce these JSON-schema "
                                         rf"keywords, so the output could break them: .*{_re(keyword)}"):
        check_schema(schema, "structured_outputs.json")
    check_schema(schema, "structured_outputs.json", allow_unenforced=True)  # the opt-in
    check_schema(schema, "tools[0].function.parameters", enforced=False)  # described to the model only


@pytest.mark.parametrize("schema, breaks_it", ENFORCED)
def test_keywords_let_through_are_enforced_by_xgrammar(schema, breaks_it):
    check_schema(schema, "structured_outputs.json")
    assert not accepts(schema, breaks_it)


@pytest.mark.parametrize("schema, message", [
    ({"type": "strin"}, "/type must be one of string, number"),
    ({"type": []}, "/type must be one of"),
    ({"properties": []}, "/properties must be an object of schemas"),
    ({"required": "a"}, "/required must be a list of property names"),
    ({"enum": []}, "/enum must be a non-empty list"),
    ({"type": "string", "minLength": -1}, "/minLength must be a non-negative integer; got -1"),
    ({"type": "string", "maxLength": 2.5}, "/maxLength must be a non-negative integer"),
    ({"type": "integer", "minimum": float("inf")}, "/minimum must be a finite number; got inf"),
    ({"type": "number", "multipleOf": 0}, "/multipleOf must be greater than 0"),
    ({"type": "array", "items": [S]}, "/items is a list (draft 4 tuples); use prefixItems"),
    ({"anyOf": []}, "/anyOf must be a non-empty list of schemas"),
    ({"properties": {"a": 3}}, "/properties/a must be a JSON schema (an object or a boolean); got int"),
    ({"$ref": "#/$defs/nope"}, "/$ref '#/$defs/nope' points at nothing in the schema"),
    (False, "the schema is false: no output can satisfy it"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "the schema can never be satisfied: minLength 5 is greater"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems 3 is greater than maxItems 1"),
    ({"type": "number", "minimum": 5, "maximum": 1}, "minimum 5 and maximum 1 leave no number"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "exclusiveMinimum 1 and maximum 1 leave no number"),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "no integer lies between its bounds"),
    ({"type": "integer", "enum": ["a", 1.5]}, "no value of its enum is of type integer"),
    ({"type": "string", "const": 3}, "no value of its const is of type string"),
    ({**AB, "required": ["a"], "properties": {"a": False}}, "required property 'a' has the schema false"),
    ({"type": "object", "properties": {"a": I}, "required": ["b"], "additionalProperties": False},
     "required property 'b' is not among its properties, and no other property is allowed"),
    ({"properties": {"x": {"properties": {"y": {"type": "strin"}}}}}, "/properties/x/properties/y/type must be"),
])
def test_invalid_and_unsatisfiable_schemas_name_the_place(schema, message):
    for enforced in (True, False):  # refused for tools with tool_choice auto too
        with pytest.raises(ValueError, match=_re(message)):
            check_schema(schema, "structured_outputs.json", enforced=enforced)


def test_nesting_is_capped_without_recursion():
    deep = S
    for _ in range(33):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match=r"subschemas are nested more than 32 levels deep \(at /items/items"):
        check_schema(deep, "w")
    check_schema(deep["items"], "w")  # 32 levels: fine
    value: list = []
    for _ in range(100_000):  # far past Python's recursion limit
        value = [value]
    with pytest.raises(ValueError, match="w is nested more than 128 levels deep"):
        check_schema({"const": value}, "w")


def _re(text: str) -> str:
    import re
    return re.escape(text)
