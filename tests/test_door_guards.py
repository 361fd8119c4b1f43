"""The guards at the Triton door (triton_inputs.parse_request, no server) and in the engine
(make_request) against the audit's inputs: nesting, 1e400 and 10**400, lone surrogates, token ids
outside the vocabulary, end_id -1, lora_name "", an out-of-range priority: each a ValueError (a
400 / INVALID_ARG) naming the field. And the exposure defaults: `inflight serve` and the OpenAI
server listen on 127.0.0.1 unless told otherwise."""
from __future__ import annotations

import json

import numpy as np
import pytest

from adapter_module import load_adapter
from backend import LLM, SamplingParams

parse = load_adapter().parse_request
DEEP = "[" * 50_000 + "]" * 50_000


def S(*values):
    return np.array([v.encode("utf-8", "surrogatepass") for v in values], dtype=np.object_)


@pytest.mark.parametrize("inputs, parameters, words", [
    ({"sampling_parameters": S(DEEP)}, None, "sampling_parameters is nested too deeply"),
    ({"sampling_parameters": S(json.dumps({"guided_json": DEEP}))}, None, "guided_json is nested too deeply"),
    ({}, json.dumps({"guided_json": DEEP}), "guided_json is nested too deeply"),
    ({"sampling_parameters": S('{"priority": 1e400}')}, None, "priority must be an integer in [-2147483648, 2147483647]"),
    ({"sampling_parameters": S(json.dumps({"priority": "1e400"}))}, None, "priority must be an integer; got '1e400'"),
    ({"sampling_parameters": S(json.dumps({"priority": 2 ** 31}))}, None, "priority must be an integer in"),
    ({"sampling_parameters": S(json.dumps({"priority": 1.5}))}, None, "priority must be an integer in"),
    ({"sampling_parameters": S('{"temperature": 1' + "0" * 400 + "}")}, None,
     "sampling parameter 'temperature': bad value 1000"),
    ({"sampling_parameters": S('{"max_tokens": 1' + "0" * 5000 + "}")}, None, "sampling_parameters is not valid JSON"),
    ({"sampling_parameters": S(json.dumps({"stop": ["ok", "\ud800"]}))}, None,
     "sampling_parameters.stop[1] is not valid Unicode text"),
    ({}, json.dumps({"guided_regex": "\udfff"}), "request parameters.guided_regex is not valid Unicode text"),
    ({"end_id": np.array([-1], np.int32)}, None, "end_id must be a token id in [0, 2000); got -1"),
    ({"end_id": np.array([2000], np.int32)}, None, "end_id must be a token id in [0, 2000); got 2000"),
    ({"sampling_parameters": S(json.dumps({"lora_name": ""}))}, None, "lora_name must be a loaded adapter's name"),
    ({}, json.dumps({"lora_name": 7}), "lora_name must be a loaded adapter's name"),
])
def test_the_triton_door_names_the_field(inputs, parameters, words):
    with pytest.raises(ValueError) as err:
        parse({"text_input": S("hi"), **inputs}, parameters, vocab_size=2000)
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("params, priority, words", [
    (dict(stop_token_ids=[-1]), 0, "stop_token_ids: token id -1 is outside the vocabulary [0, 2000)"),
    (dict(stop_token_ids=[5, 10 ** 12]), 0, "token id 1000000000000 is outside the vocabulary"),
    (dict(stop_token_ids=[2 ** 64]), 0, "token id 18446744073709551616 is outside the vocabulary"),
    (dict(), 2 ** 40, "priority must be an integer in [-2147483648, 2147483647]; got 1099511627776"),
    (dict(), 0, "prompt is not valid Unicode text"),
    (dict(stop=["a\ud800"]), 0, "stop_words: each entry must be valid Unicode text"),
    (dict(bad_words=["\udfff"]), 0, "bad_words: each entry must be valid Unicode text"),
])
def test_the_engine_refuses_before_any_block(default_model_dir, params, priority, words):
    llm = _llm(default_model_dir)
    prompt = "hi\ud800" if words.startswith("prompt") else "hi"
    with pytest.raises(ValueError) as err:
        llm.engine.add_request("bad", prompt, SamplingParams(max_tokens=2, **params), priority=priority)
    assert words in str(err.value), str(err.value)
    assert not llm.engine.has_work() and llm.stats()["kv_blocks_used"] == 0
    assert llm.generate("fine", SamplingParams(max_tokens=2, temperature=0.0))[0].finish_reason == "length"


_cache = {}


def _llm(path):
    if "llm" not in _cache:
        _cache["llm"] = LLM(str(path), max_model_len=64)
    return _cache["llm"]


def test_servers_listen_on_this_machine_unless_told_otherwise():
    from client.cli import build_parser
    from openai_server.__main__ import build_parser as openai_parser

    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    assert build_parser().parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"
    assert openai_parser().parse_args([]).host == "127.0.0.1"


class _RefusingEngine:
    """Refuses every request after arrival, as the engine does a constraint that does not compile."""
    vocab_size, max_model_len, tokenizer = 100, 64, None

    def __init__(self, kind):
        self.kind = kind

    def add_request(self, rid, prompt, params, on_output, priority=0, **kw):
        from backend.core.outputs import RequestOutput
        on_output(RequestOutput(rid, [], [], [], "", "", True, "error", "structured_outputs.regex: cannot be compiled",
                                error_kind=self.kind))

    def abort(self, rid):
        return False

    def stats(self):
        return {}

    def shutdown(self):
        pass


class _Sender:
    def is_cancelled(self):
        return False


@pytest.mark.parametrize("kind, code", [("invalid", "INVALID_ARG"), ("unavailable", "UNAVAILABLE"), (None, "INTERNAL")])
def test_a_refusal_after_arrival_keeps_its_code(kind, code):
    import threading

    adapter = load_adapter()
    got, done = [], threading.Event()
    frontend = adapter.Frontend(_RefusingEngine(kind), lambda s, t, e, f: (got.append(e), done.set()),
                                poll_interval=0.01)
    try:
        frontend.submit("r", {"text_input": S("hi")}, _Sender())
        assert done.wait(10)
        assert got[-1].code == code and got[-1] == "structured_outputs.regex: cannot be compiled"
    finally:
        frontend.close(timeout=1)
