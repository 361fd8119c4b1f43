"""Every sampling knob of issue 43 through each door without a server: the vLLM backend's
`sampling_parameters` JSON and request parameters, the TensorRT-LLM format's embedding bias
([1, 1] shapes, words tokenized, weights summed into logit_bias), and the OpenAI body (OpenAI's
logit_bias map, vLLM's extra fields); each arrives as the SamplingParams the Python API would
make, and a bad value is refused naming the field."""
import json

import numpy as np
import pytest

from adapter_module import load_adapter
from backend.core.sampling_params import SamplingParams
from openai_server.translate import APIError, parse_chat, parse_completion

parse = load_adapter().parse_request

KNOBS = {"min_p": 0.2, "logit_bias": {"17": -5.0, "3": 2.5}, "allowed_token_ids": [3, 17, 40, 2],
         "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
         "truncate_prompt_tokens": 12, "temperature": 0.8, "seed": 5, "max_tokens": 9,
         "structured_outputs": {"regex": "[a-z]+"}}
WANT = SamplingParams.from_dict(KNOBS)


def S(*values):
    return np.array([v.encode() for v in values], dtype=np.object_)


def _same(p: SamplingParams, want: SamplingParams = WANT):
    for name in ("min_p", "logit_bias", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens", "truncate_prompt_tokens", "temperature", "seed", "max_tokens"):
        assert getattr(p, name) == getattr(want, name), name
    assert p.structured_outputs == want.structured_outputs


def test_sampling_parameters_json_and_request_parameters():
    _same(parse({"text_input": S("hi"), "sampling_parameters": S(json.dumps(KNOBS))}).params)
    _same(parse({"text_input": S("hi")}, parameters=json.dumps(KNOBS)).params)  # gRPC parameters= / HTTP fields
    strings = {k: (json.dumps(v) if isinstance(v, (dict, list)) else str(v).lower() if isinstance(v, bool) else v)
               for k, v in KNOBS.items() if k not in ("logit_bias", "allowed_token_ids")}
    _same(parse({"text_input": S("hi"), "sampling_parameters": S(json.dumps(strings))}).params,
          SamplingParams.from_dict({k: v for k, v in KNOBS.items() if k not in ("logit_bias", "allowed_token_ids")}))


@pytest.mark.parametrize("key,value,message", [
    ("min_p", 1.5, "^min_p must be"), ("logit_bias", {"3": -101}, "^logit_bias must be"),
    ("logit_bias", {"x": 1}, "'logit_bias': bad value"), ("allowed_token_ids", [], "^allowed_token_ids must"),
    ("truncate_prompt_tokens", 0, "^truncate_prompt_tokens must"), ("skip_special_tokens", "maybe", "bad value")])
def test_sampling_parameters_refuse_bad_values_naming_the_field(key, value, message):
    with pytest.raises(ValueError, match=message):
        parse({"text_input": S("hi"), "sampling_parameters": S(json.dumps({key: value}))})


def _encode(word):  # a stand-in tokenizer: one id per character
    return [ord(c) % 50 for c in word]


def test_tensorrt_llm_embedding_bias_becomes_logit_bias():
    inputs = {"text_input": np.array([[b"hi"]], dtype=np.object_),
              "embedding_bias_words": np.array([[b"ab", b"b", b"z"]], dtype=np.object_)[0],
              "embedding_bias_weights": np.float32([2.0, 1.5, -4.0]),
              "sampling_parameters": S(json.dumps({"logit_bias": {"1": 0.25}}))}
    p = parse(inputs, encode=_encode).params
    a, b, z = _encode("a")[0], _encode("b")[0], _encode("z")[0]
    assert p.logit_bias == {a: 2.0, b: 3.5, z: -4.0, 1: 0.25}
    with pytest.raises(ValueError, match="embedding_bias_weights must hold one FP32 weight per word"):
        parse({**inputs, "embedding_bias_weights": np.float32([1.0])}, encode=_encode)
    with pytest.raises(ValueError, match="go together"):
        parse({k: v for k, v in inputs.items() if k != "embedding_bias_weights"}, encode=_encode)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        parse(inputs)
    with pytest.raises(ValueError, match="^logit_bias must be a finite number"):
        parse({**inputs, "embedding_bias_weights": np.float32([90.0, 20.0, 1.0])}, encode=_encode)  # b: 110


OPENAI = {"bad_words": ["zebra"], "min_p": 0.2, "logit_bias": {"17": -5, "3": 2.5}, "allowed_token_ids": [3, 17, 40, 2],
          "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
          "truncate_prompt_tokens": 12, "temperature": 0.8, "seed": 5, "max_tokens": 9,
          "structured_outputs": {"regex": "[a-z]+"}}


def test_openai_completions_and_chat_carry_every_knob():
    gen = parse_completion({"model": "llm", "prompt": "hi", **OPENAI})
    _same(SamplingParams.from_dict(gen.sampling))
    # what goes to Triton is that JSON, which the llm model reads back to the same settings
    _same(parse({"text_input": S("hi"), "sampling_parameters": S(json.dumps(gen.sampling))}).params)
    chat = parse_chat({"model": "llm", "messages": [{"role": "user", "content": "hi"}], **OPENAI}, lambda m: "x")
    _same(SamplingParams.from_dict(chat.sampling))
    assert gen.sampling["bad_words"] == chat.sampling["bad_words"] == ["zebra"]
    with pytest.raises(APIError) as err:
        parse_completion({"model": "llm", "prompt": "hi", "bad_words": [3]})
    assert err.value.param == "bad_words"


def test_openai_refuses_a_bias_out_of_range_naming_logit_bias():
    with pytest.raises(APIError) as err:
        parse_completion({"model": "llm", "prompt": "hi", "logit_bias": {"3": 150}})
    assert err.value.status == 400 and err.value.param == "logit_bias"
    assert err.value.message.startswith("logit_bias must be a finite number >= -100.0 and <= 100.0")


def test_prompt_logprobs_output_with_the_first_tokens_only():
    """The Triton output: vLLM's shape as JSON (null first), in the response with the first tokens,
    null in later streamed ones; the whole list in a non-streaming answer."""
    load_adapter()
    from live_request import Live
    from triton_outputs import output_tensors

    from backend.core.outputs import Logprob, RequestOutput
    prompt = [None, {7: Logprob(-1.5, 2, "a"), 9: Logprob(-0.5, 1, "b")}]

    def out(new, total):
        return RequestOutput("r", [1, 7], new, total, "", "", False, None, prompt_logprobs=prompt)

    live = Live("r", "", None, stream=True, exclude_input=True, prompt_text=None, arrival=0.0,
                returns=frozenset({"return_prompt_logprobs"}))
    first, later = out([5], [5]), out([6], [5, 6])
    live.latest = {0: first}
    got = json.loads(output_tensors(live, {0: first}, str)["prompt_logprobs"][0])
    assert got == [None, {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "a"},
                          "9": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]
    live.latest = {0: later}
    assert output_tensors(live, {0: later}, str)["prompt_logprobs"][0] == b"null"
    whole = Live("r", "", None, stream=False, exclude_input=True, prompt_text=None, arrival=0.0,
                 returns=frozenset({"return_prompt_logprobs"}), latest={0: later})
    assert json.loads(output_tensors(whole, {0: later}, str)["prompt_logprobs"][0]) == got
    p = parse({"text_input": S("hi"), "return_prompt_logprobs": np.array([True]),
               "sampling_parameters": S('{"prompt_logprobs": 2}')})
    assert p.params.prompt_logprobs == 2 and "return_prompt_logprobs" in p.returns
