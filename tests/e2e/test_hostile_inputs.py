"""The Triton door against the audit's hostile inputs, on the real tritonserver (the session's): each
is a 400 over HTTP generate (INVALID_ARG) naming the field, and the same message over the gRPC
stream; afterwards the server still serves and holds no KV block. Nesting, 1e400 and lone
surrogates in `sampling_parameters` and the request parameters; token ids outside the vocabulary;
end_id -1; lora_name ""; schema keywords xgrammar cannot enforce; a schema nested too deep."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from .conftest import requires_tritonserver, wait_until
from .raw_requests import array, grpc_stream, http_generate
from .series import gauge

pytestmark = requires_tritonserver

DEEP = "[" * 50_000 + "]" * 50_000


def post(server, body: dict) -> tuple[int, str]:
    """HTTP generate with a body written by hand: (status, error message or "")."""
    data = json.dumps(body).encode()  # "\ud800" stays the JSON escape a client sends
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode()).get("error", "")


def sampling(**keys) -> dict:
    return {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 2, **keys})}


def nested_items(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


CASES = {
    "guided_json nested 50k deep": (sampling(guided_json=DEEP), "guided_json is nested too deeply"),
    "guided_json as a request parameter": ({"text_input": "hi", "guided_json": DEEP}, "guided_json is nested too deeply"),
    "sampling_parameters nested 50k deep": ({"text_input": "hi", "sampling_parameters": DEEP},
                                            "sampling_parameters is nested too deeply"),
    "priority 1e400": ({"text_input": "hi", "sampling_parameters": '{"priority": 1e400}'},
                       "priority must be an integer in [-2147483648, 2147483647]"),
    "temperature 1e400": ({"text_input": "hi", "sampling_parameters": '{"temperature": 1e400}'},
                          "temperature must be a finite number"),
    "temperature 10**400": ({"text_input": "hi", "sampling_parameters": '{"temperature": 1' + "0" * 400 + "}"},
                            "sampling parameter 'temperature': bad value"),
    "lone surrogate in stop": (sampling(stop=["ok", "\ud800"]), "sampling_parameters.stop[1] is not valid Unicode"),
    "stop_token_ids -1": (sampling(stop_token_ids=[-1]), "stop_token_ids: token id -1 is outside the vocabulary"),
    "stop_token_ids 10^12": (sampling(stop_token_ids=[10 ** 12]), "token id 1000000000000 is outside the vocabulary"),
    "stop_token_ids 2^64": (sampling(stop_token_ids=[2 ** 64]), "token id 18446744073709551616 is outside"),
    "max_tokens 10^400": (sampling(max_tokens=10 ** 400), "exceeds max_model_len"),
    'lora_name ""': (sampling(lora_name=""), "lora_name must be a loaded adapter's name"),
    "uniqueItems": (sampling(structured_outputs={"json": {"type": "array", "uniqueItems": True}}),
                    "xgrammar cannot enforce these JSON-schema keywords, so the output could break them: uniqueItems"),
    "if/then/else": (sampling(guided_json=json.dumps({"type": "object", "if": {}, "then": {}, "else": {}})),
                     "if at /, then at /, else at /"),
    "nested 40 levels": (sampling(structured_outputs={"json": nested_items(40)}),
                         "subschemas are nested more than 32 levels deep"),
    # refused after arrival, by the compile off the request path: still a 400 (INVALID_ARG)
    "a regex xgrammar refuses": (sampling(structured_outputs={"regex": "(ab"}),
                                 "structured_outputs.regex: cannot be compiled"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_hostile_input_is_a_400_naming_its_field(server, case):
    body, words = CASES[case]
    status, error = post(server, body)
    assert status == 400 and words in error, (status, error)


def test_a_lone_surrogate_in_the_http_body_itself(server):
    """In an input, Triton 2.51's HTTP front end refuses the body itself (a 500 in its JSON parser's
    words: upstream, before any model). In a request parameter it reaches the model as bytes UTF-8
    refuses: a 400 naming the parameters (not the whole execute batch failing). Inside
    sampling_parameters (JSON text in the JSON) it is named exactly, above. Over gRPC, protobuf
    strings must be UTF-8: the client cannot send one."""
    status, error = post(server, {"text_input": "a\ud800"})
    assert status == 500 and "surrogate pair in string is invalid" in error, (status, error)
    status, error = post(server, {"text_input": "hi", "guided_regex": "\udc00"})
    assert status == 400 and "the request parameters are not valid UTF-8 text" in error, (status, error)


def test_over_grpc_the_same_inputs_name_the_same_fields(server):
    for case in ("priority 1e400", "lone surrogate in stop", "stop_token_ids -1", "uniqueItems"):
        body, words = CASES[case]
        with pytest.raises(RuntimeError, match=words.replace("[", r"\[").replace("(", r"\(")):
            grpc_stream(server.grpc_url, {"text_input": array("hi"), "sampling_parameters": array(body["sampling_parameters"])})
    with pytest.raises(RuntimeError, match=r"end_id must be a token id in \[0, 2000\); got -1"):
        grpc_stream(server.grpc_url, {"text_input": array("hi"), "end_id": np.array([-1], np.int32)})


def test_after_all_of_them_the_server_serves_and_holds_no_kv(server):
    out = http_generate(server.http_url, {"text_input": "hello", "max_tokens": 3, "ignore_eos": True}, stream=False)
    assert out[0]["text_output"]
    wait_until(lambda: gauge(server, "inflight_kv_blocks", state="used") == 0, timeout=10)
