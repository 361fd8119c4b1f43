"""Structured-output settings as Triton clients send them (triton_inputs.parse_request, no server):
vLLM's `structured_outputs` inside the sampling_parameters tensor, as the vLLM backend's CI sends it
(a JSON string inside the JSON) or as an object; the older guided_* keys, also as request
parameters (scalars: a choice list arrives as its JSON text); refusals that name the field."""
import json

import numpy as np
import pytest

from adapter_module import load_adapter

parse = load_adapter().parse_request


def S(*values):
    return np.array([v.encode() for v in values], dtype=np.object_)


def test_the_vllm_backends_guided_choice_shape():
    # ci/L0_backend_vllm/accuracy_test: sampling_params["structured_outputs"] = json.dumps({"choice": [...]})
    sampling = {"temperature": 0, "top_p": 1, "structured_outputs": json.dumps({"choice": ["Positive", "Negative"]})}
    parsed = parse({"text_input": S("Classify"), "sampling_parameters": S(json.dumps(sampling))},
                   parameters=json.dumps(sampling))
    assert parsed.params.structured_outputs.choice == ("Positive", "Negative")
    assert parsed.params.temperature == 0


def test_an_object_and_every_older_spelling():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_object = parse({"text_input": S("x"), "sampling_parameters": S(json.dumps(
        {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}))})
    spec = as_object.params.structured_outputs
    assert spec.json == schema and spec.disable_any_whitespace
    for key, value, field in (("guided_json", json.dumps(schema), "json"), ("guided_regex", "a+", "regex"),
                              ("guided_choice", json.dumps(["x", "y"]), "choice"),
                              ("guided_grammar", 'root ::= "a"', "grammar"), ("guided_json_object", "true", "json_object"),
                              ("guided_decoding", json.dumps({"regex": "b"}), "regex")):
        parsed = parse({"text_input": S("x")}, parameters=json.dumps({key: value}))  # request parameters
        assert parsed.params.structured_outputs.kind == field, key


@pytest.mark.parametrize("sampling, words", [
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "set exactly one of"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "one constraint per request"),
    ({"structured_outputs": "{not json"}, "structured_outputs is not valid JSON"),
    ({"structured_outputs": {"jsn": {}}}, "unknown key(s) 'jsn'"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be a list"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern is not supported"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "only xgrammar is available"),
])
def test_malformed_constraints_are_refused_naming_the_field(sampling, words):
    with pytest.raises(ValueError) as err:
        parse({"text_input": S("x"), "sampling_parameters": S(json.dumps(sampling))})
    assert words in str(err.value), str(err.value)
