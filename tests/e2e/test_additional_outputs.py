"""The vLLM backend's additional-outputs contract (its docs/additional_outputs.md and src/model.py),
end to end: every combination of the five return_* flags, streaming and not, over gRPC and HTTP,
gives exactly the outputs asked for (besides text_output and our output_ids), with that backend's
types and per-response semantics."""
import json
import math

import numpy as np
import pytest

from .conftest import requires_tritonserver
from .raw_requests import array, grpc_stream, http_generate

pytestmark = requires_tritonserver

FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
         "return_num_output_tokens")
OUTPUT_OF = dict(zip(FLAGS, ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                             "num_output_tokens")))
PROMPT = "In this example,"
MAX_TOKENS = 3
SAMPLING = {"temperature": "0", "max_tokens": str(MAX_TOKENS), "ignore_eos": "true", "logprobs": 1}


def values(response, name):
    """One output as a flat list, whether a numpy array (gRPC) or JSON (HTTP: a one-element output
    is written as a bare value)."""
    value = response[name]
    if isinstance(value, np.ndarray):
        return [v.decode() if isinstance(v, bytes) else v.item() for v in value.reshape(-1)]
    return value if isinstance(value, list) else [value]


def send(server, protocol, stream, asked, sampling=SAMPLING):
    flags = {f: f in asked for f in FLAGS}
    if protocol == "grpc":
        inputs = {"text_input": array(PROMPT), "stream": array(stream),
                  "sampling_parameters": array(json.dumps(sampling))}
        inputs.update((f, array(v)) for f, v in flags.items())
        return grpc_stream(server.grpc_url, inputs)
    body = {"text_input": PROMPT, "stream": stream, "sampling_parameters": json.dumps(sampling), **flags}
    return http_generate(server.http_url, body, stream)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "once"])
@pytest.mark.parametrize("mask", range(32), ids=lambda m: f"flags{m:05b}")
def test_every_combination_of_the_return_flags(server, llm, protocol, stream, mask):
    asked = {f for i, f in enumerate(FLAGS) if mask >> i & 1}
    responses = send(server, protocol, stream, asked)
    ref = llm.greedy(PROMPT, MAX_TOKENS)
    assert len(responses) == (len(responses) if stream else 1) and responses
    for i, response in enumerate(responses):
        assert set(response) == {"text_output", "output_ids"} | {OUTPUT_OF[f] for f in asked}, i
    tokens = [values(r, "output_ids") for r in responses]
    if not stream:
        tokens = [tokens[0][len(ref.prompt_token_ids):]]  # the prompt leads a non-streaming answer
    assert sum(tokens, []) == ref.token_ids
    for i, response in enumerate(responses):
        last = i == len(responses) - 1
        if "return_finish_reason" in asked:
            assert values(response, "finish_reason") == (["length"] if last else ["None"])
        if "return_num_input_tokens" in asked:
            assert values(response, "num_input_tokens") == [len(ref.prompt_token_ids)]
        if "return_num_output_tokens" in asked:  # this response's tokens, not the total
            assert values(response, "num_output_tokens") == [len(tokens[i])]
        if "return_logprobs" in asked:
            logprobs = json.loads(values(response, "logprobs")[0])
            assert len(logprobs) == len(tokens[i])
            for token, step in zip(tokens[i], logprobs):
                assert 1 <= len(step) <= SAMPLING["logprobs"] + 1 and str(token) in step
                assert step[str(token)]["rank"] == 1  # greedy: the sampled token is the likeliest
                assert set(step[str(token)]) == {"logprob", "rank", "decoded_token"}
        if "return_cumulative_logprob" in asked:
            assert values(response, "cumulative_logprob")[0] <= 0.0
    if {"return_logprobs", "return_cumulative_logprob"} <= asked:
        every = [json.loads(values(r, "logprobs")[0]) for r in responses]
        total = sum(step[str(t)]["logprob"] for lps, toks in zip(every, tokens) for step, t in zip(lps, toks))
        assert math.isclose(values(responses[-1], "cumulative_logprob")[0], total, rel_tol=1e-5, abs_tol=1e-5)
    if protocol == "grpc" and "return_num_input_tokens" in asked:
        assert responses[0]["num_input_tokens"].dtype == np.uint32


def test_types_as_the_vllm_backend_declares_them(server):
    responses = send(server, "grpc", True, set(FLAGS))
    types = {name: (a.dtype, a.shape) for name, a in responses[0].items()}
    assert types == {"text_output": (np.object_, (1,)), "output_ids": (np.int32, (1,)),
                     "finish_reason": (np.object_, (1,)), "cumulative_logprob": (np.float32, (1,)),
                     "logprobs": (np.object_, (1,)), "num_input_tokens": (np.uint32, (1,)),
                     "num_output_tokens": (np.uint32, (1,))}


def test_without_the_logprobs_key_logprobs_is_null_and_cumulative_nan(server):
    sampling = {k: v for k, v in SAMPLING.items() if k != "logprobs"}
    responses = send(server, "grpc", False, {"return_logprobs", "return_cumulative_logprob"}, sampling)
    assert values(responses[0], "logprobs") == ["null"]
    assert math.isnan(values(responses[0], "cumulative_logprob")[0])


def test_streaming_with_the_prompt_in_the_output_is_refused_with_vllms_message(server):
    inputs = {"text_input": array(PROMPT), "stream": array(True), "exclude_input_in_output": array(False)}
    with pytest.raises(RuntimeError, match="When streaming, `exclude_input_in_output` = False is not allowed."):
        grpc_stream(server.grpc_url, inputs)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_cli_asks_for_what_it_prints(server, protocol, capsys):
    from client.cli import main

    url = server.grpc_url if protocol == "grpc" else f"http://{server.http_url}"
    assert main(["generate", "Hello world", "--url", url, "--max-tokens", "5", "--temperature", "0",
                 "--ignore-eos", "--logprobs", "0", "--repetition-penalty", "1.2", "--bad-word", "zebra",
                 "-v"]) == 0
    err = capsys.readouterr().err
    assert "[finish_reason: length]" in err and "[cumulative_logprob: -" in err


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "once"])
def test_n_completions_come_in_one_response_as_the_vllm_backend_shapes_them(server, llm, stream):
    sampling = {**SAMPLING, "n": 2}
    responses = send(server, "grpc", stream, {"return_finish_reason", "return_num_output_tokens"}, sampling)
    ref = llm.greedy(PROMPT, MAX_TOKENS)
    texts = ["", ""]
    for r in responses:
        assert r["text_output"].shape == (2,) and r["num_output_tokens"].shape == (2,)
        assert "output_ids" not in r  # ragged across completions: left out for n > 1
        texts = [a + b.decode() for a, b in zip(texts, r["text_output"])]
    assert values(responses[-1], "finish_reason") == ["length", "length"]
    assert sum(int(r["num_output_tokens"][1]) for r in responses) == MAX_TOKENS
    want = ref.text if stream else PROMPT + ref.text
    assert texts == [want, want]  # greedy: both completions are the engine's greedy answer
