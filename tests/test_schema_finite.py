"""Issue 46, cause 14: a JSON schema with no finite instance (a required property whose `$ref` is the
schema itself, or any required recursion with no base case) is refused before generation: a
ValueError naming the field at the engine, a 400 naming the parameter at the OpenAI door, an
INVALID_ARG at the Triton door (its request parser, as model.py calls it). Recursive schemas with
a way to stop (an optional child, an empty array, a scalar branch) still pass, and xgrammar
compiles them and accepts a finite instance."""
from __future__ import annotations

import json

import numpy as np
import pytest

from adapter_module import load_adapter
from backend.core.schema_check import check_schema
from openai_server.translate import APIError, parse_chat

SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # the audit's schema
NEVER_ENDS = {
    "a required property whose $ref is the schema": SELF,
    "untyped, as xgrammar makes it an object": {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "two definitions requiring each other": {
        "$defs": {"x": {"type": "object", "properties": {"y": {"$ref": "#/$defs/y"}}, "required": ["y"]},
                  "y": {"type": "object", "properties": {"x": {"$ref": "#/$defs/x"}}, "required": ["x"]}},
        "$ref": "#/$defs/x"},
    "an array of at least one of itself": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "every anyOf branch recursive": {"anyOf": [SELF, {"type": "array", "items": {"$ref": "#"}, "minItems": 2}]},
    "required through additionalProperties": {"type": "object", "additionalProperties": {"$ref": "#"},
                                              "required": ["k"]},
    "deep inside a property": {"type": "object", "required": ["p"], "properties": {"p": {
        "type": "object", "required": ["q"], "properties": {"q": {"$ref": "#/properties/p"}}}}},
}
FINITE = {
    "an optional recursive child": {"type": "object", "properties": {"a": {"$ref": "#"}}},
    "a tree whose children may be empty": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["children"]},
    "a nullable recursion": {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "a scalar branch": {"anyOf": [{"type": "integer"}, SELF]},
    "a recursion through an optional definition": {
        "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}, "v": {"type": "integer"}},
                        "required": ["v"]}}, "$ref": "#/$defs/n"},
}


@pytest.mark.parametrize("case", list(NEVER_ENDS))
def test_a_schema_with_no_finite_instance_is_refused_naming_the_field(case):
    with pytest.raises(ValueError) as err:
        check_schema(NEVER_ENDS[case], "structured_outputs.json")
    message = str(err.value)
    assert message.startswith("structured_outputs.json: no finite value satisfies the schema"), message
    assert "\n" not in message


@pytest.mark.parametrize("case", list(FINITE))
def test_recursive_schemas_with_a_base_case_pass_and_xgrammar_ends_them(case):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    check_schema(FINITE[case], "structured_outputs.json")
    grammar = xgr.Grammar.from_json_schema(json.dumps(FINITE[case]))
    instance = {"an optional recursive child": "{}", "a tree whose children may be empty": '{"children": []}',
                "a nullable recursion": "null", "a scalar branch": "1",
                "a recursion through an optional definition": '{"v": 1}'}[case]
    assert _is_grammar_accept_string(grammar, instance)


def test_a_schema_described_to_the_model_only_is_not_judged():
    check_schema(SELF, "tools[0].function.parameters", enforced=False)


def test_the_openai_door_answers_a_400_naming_response_format():
    body = {"model": "llm", "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF}}}
    with pytest.raises(APIError) as err:
        parse_chat(body, lambda messages, **_: [1, 2, 3])
    assert err.value.status == 400 and err.value.param == "response_format", err.value.body()
    assert "no finite value satisfies the schema" in err.value.message


def test_the_triton_door_refuses_it_naming_structured_outputs():
    def S(*values):
        return np.array([v.encode() for v in values], dtype=np.object_)

    sampling = {"max_tokens": 4, "structured_outputs": {"json": SELF}}
    with pytest.raises(ValueError) as err:
        load_adapter().parse_request({"text_input": S("x"), "sampling_parameters": S(json.dumps(sampling))})
    assert "structured_outputs.json" in str(err.value) and "no finite value" in str(err.value), err.value
