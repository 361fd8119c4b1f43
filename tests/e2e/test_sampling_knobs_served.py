"""Issue 43's sampling knobs through a real tritonserver (the session's server), each door against
the in-process engine on the same checkpoint with the same settings and seeds: the vLLM backend's
`sampling_parameters` over gRPC (streamed) and HTTP generate, the TensorRT-LLM format's embedding
bias on `llm_trtllm`, and the official `openai` SDK; the knobs composed with each other and with
structured outputs."""
import json
import re

import numpy as np
import pytest

from backend import SamplingParams
from serving.openai_launcher import OpenAIServer

from .conftest import requires_tritonserver
from .raw_requests import array, grpc_stream, http_generate

pytestmark = requires_tritonserver
PROMPT = "The quick brown fox jumps over the lazy dog and then"


def _composed(llm):
    """Every knob at once: allowed tokens (specials among them), a bias, min_p, the text switches,
    a stop string kept in the output, a truncated prompt; seeded sampling."""
    tok = llm.llm.tokenizer
    words = tok.encode(" a the cat dog sat ran on in of", add_special_tokens=False)
    specials = sorted(tok.all_special_ids)
    return {"temperature": 1.0, "seed": 11, "max_tokens": 24, "min_p": 0.05, "ignore_eos": True,
            "allowed_token_ids": words + specials, "logit_bias": {str(words[1]): 2.0, str(specials[1]): 1.0},
            "skip_special_tokens": False, "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True, "stop": [" sat"], "truncate_prompt_tokens": 6}


def _reference(llm, sampling):
    return llm.generate([PROMPT], SamplingParams.from_dict(sampling))[0]


def test_sampling_parameters_over_grpc_and_http(server, llm):
    sampling = _composed(llm)
    ref = _reference(llm, sampling)
    assert len(ref.prompt_token_ids) == 6 and set(ref.token_ids) <= set(sampling["allowed_token_ids"])
    responses = grpc_stream(server.grpc_url, {"text_input": array(PROMPT), "stream": array(True),
                                              "sampling_parameters": array(json.dumps(sampling)),
                                              "return_num_input_tokens": array(True)})
    assert "".join(r["text_output"][0].decode() for r in responses) == ref.text
    assert [int(t) for r in responses for t in r["output_ids"]] == ref.token_ids
    assert int(responses[0]["num_input_tokens"][0]) == 6
    events = http_generate(server.http_url, {"text_input": PROMPT, "sampling_parameters": json.dumps(sampling),
                                             "exclude_input_in_output": True}, stream=False)
    assert events[0]["text_output"] == ref.text


def test_knobs_with_structured_outputs(server, llm):
    sampling = {"temperature": 0.9, "seed": 3, "max_tokens": 20, "min_p": 0.02, "logit_bias": {"30": 3.0},
                "structured_outputs": {"regex": "[a-z]{2,8}( [a-z]{2,8}){1,3}"}}
    ref = _reference(llm, sampling)
    assert re.fullmatch(sampling["structured_outputs"]["regex"], ref.text)
    events = http_generate(server.http_url, {"text_input": PROMPT, "sampling_parameters": json.dumps(sampling),
                                             "exclude_input_in_output": True}, stream=False)
    assert events[0]["text_output"] == ref.text


def test_tensorrt_llm_embedding_bias(server, llm):
    tok = llm.llm.tokenizer
    words, weights = [" cat", " dog"], [6.0, -3.0]
    bias = {}
    for word, weight in zip(words, weights):
        for t in tok.encode(word, add_special_tokens=False):
            bias[t] = bias.get(t, 0.0) + weight
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, logit_bias=bias))[0]
    plain = llm.greedy(PROMPT, 10)
    assert ref.token_ids != plain.token_ids, "the bias changes the greedy output"
    inputs = {"text_input": array(PROMPT, trtllm=True), "max_tokens": np.int32([[10]]),
              "temperature": np.float32([[0.0]]), "exclude_input_in_output": np.bool_([[True]]),
              "embedding_bias_words": np.array([[w.encode() for w in words]], dtype=np.object_),
              "embedding_bias_weights": np.float32([weights])}
    responses = grpc_stream(server.grpc_url, inputs, model="llm_trtllm")
    assert responses[-1]["text_output"][0, 0].decode() == ref.text


@pytest.fixture(scope="module")
def api(server, model_path):
    openai = pytest.importorskip("openai")
    with OpenAIServer(server.grpc_url, model_path) as api_server:
        yield openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_openai_sdk_sends_every_knob(api, llm):
    sampling = _composed(llm)
    ref = _reference(llm, sampling)
    extra = {k: v for k, v in sampling.items()
             if k not in ("temperature", "seed", "max_tokens", "stop", "logit_bias")}
    got = api.completions.create(model="llm", prompt=PROMPT, temperature=1.0, seed=11, max_tokens=24, stop=[" sat"],
                                 logit_bias=sampling["logit_bias"], extra_body=extra)
    assert got.choices[0].text == ref.text and got.usage.prompt_tokens == 6
    streamed = api.completions.create(model="llm", prompt=PROMPT, temperature=1.0, seed=11, max_tokens=24,
                                      stop=[" sat"], logit_bias=sampling["logit_bias"], extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text
    structured = {"temperature": 0.9, "seed": 3, "max_tokens": 20, "min_p": 0.02, "logit_bias": {"30": 3.0},
                  "structured_outputs": {"regex": "[a-z]{2,8}( [a-z]{2,8}){1,3}"}}
    got = api.completions.create(model="llm", prompt=PROMPT, temperature=0.9, seed=3, max_tokens=20,
                                 logit_bias={"30": 3.0},
                                 extra_body={"min_p": 0.02, "structured_outputs": structured["structured_outputs"]})
    assert got.choices[0].text == _reference(llm, structured).text


def test_the_openai_sdk_gets_a_400_naming_a_bad_knob(api):
    import openai
    for kwargs, param in (({"logit_bias": {"3": 500}}, "logit_bias"), ({"extra_body": {"min_p": 3}}, "min_p"),
                          ({"extra_body": {"allowed_token_ids": [10**6]}}, None)):
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model="llm", prompt="hi", max_tokens=2, **kwargs)
        if param:
            assert err.value.body["param"] == param
        else:
            assert "allowed_token_ids: token id 1000000 is outside the vocabulary" in err.value.body["message"]


def _same_prompt_logprobs(got, ref):
    """The JSON shape (token ids as strings) against the engine's RequestOutput.prompt_logprobs."""
    assert got[0] is None and ref[0] is None and len(got) == len(ref)
    for entries, want in zip(got[1:], ref[1:]):
        assert {int(k) for k in entries} == set(want)
        for tok, lp in want.items():
            assert entries[str(tok)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entries[str(tok)]["rank"] == lp.rank and entries[str(tok)]["decoded_token"] == lp.decoded_token


def test_prompt_logprobs_over_grpc_and_the_openai_sdk(server, api, llm):
    sampling = {"temperature": 0.0, "max_tokens": 4, "prompt_logprobs": 2}
    ref = _reference(llm, sampling)
    assert len(ref.prompt_logprobs) == len(ref.prompt_token_ids) > 5
    for stream in (True, False):
        responses = grpc_stream(server.grpc_url, {"text_input": array(PROMPT), "stream": array(stream),
                                                  "exclude_input_in_output": array(True),
                                                  "sampling_parameters": array(json.dumps(sampling)),
                                                  "return_prompt_logprobs": array(True)})
        got = [json.loads(r["prompt_logprobs"][0]) for r in responses]
        _same_prompt_logprobs(got[0], ref.prompt_logprobs)
        assert all(g is None for g in got[1:])  # with the first tokens only
    body = api.completions.create(model="llm", prompt=PROMPT, temperature=0, max_tokens=4,
                                  extra_body={"prompt_logprobs": 2})
    _same_prompt_logprobs(body.choices[0].model_extra["prompt_logprobs"], ref.prompt_logprobs)
    assert body.choices[0].text == ref.text
