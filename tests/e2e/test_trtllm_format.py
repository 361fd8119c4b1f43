"""The TensorRT-LLM request format ([1, 1] shapes, its input names) on `llm_trtllm`, built exactly
as Triton's OpenAI frontend builds it for a non-vLLM backend (engine/utils/triton.py,
_create_trtllm_generate_request); what we cannot honour is refused naming the input."""
import numpy as np
import pytest

from .conftest import requires_tritonserver
from .raw_requests import array, grpc_stream, http_generate

pytestmark = requires_tritonserver
MODEL = "llm_trtllm"


def openai_frontend_request(prompt, stream, max_tokens, stop=None, echo=None):
    """_create_trtllm_generate_request for a completion with temperature 0 and a seed."""
    inputs = {"text_input": np.array([[prompt.encode()]], dtype=np.object_), "stream": np.bool_([[stream]]),
              "max_tokens": np.int32([[max_tokens]])}
    if stop:
        inputs["stop_words"] = np.array([[s.encode() for s in stop]], dtype=np.object_)
    inputs.update(top_p=np.float32([[1.0]]), frequency_penalty=np.float32([[0.0]]),
                  presence_penalty=np.float32([[0.0]]), seed=np.uint64([[1234]]), temperature=np.float32([[0.0]]))
    if echo is not None:
        inputs["exclude_input_in_output"] = np.bool_([[not echo]])
    inputs["return_num_input_tokens"] = np.bool_([[True]])
    inputs["return_num_output_tokens"] = np.bool_([[True]])
    return inputs


@pytest.mark.parametrize("stream", [True, False])
def test_the_openai_frontends_tensorrt_llm_format(server, llm, stream):
    ref = llm.greedy("The quick brown fox", 6)
    responses = grpc_stream(server.grpc_url, openai_frontend_request("The quick brown fox", stream, 6, echo=False),
                            model=MODEL)
    assert all(r["text_output"].shape == (1, 1) for r in responses)  # the batch dimension comes back
    assert "".join(r["text_output"][0, 0].decode() for r in responses) == ref.text
    # what the frontend reads for `usage`: the prompt's tokens, and the completion's summed over responses
    assert int(responses[0]["num_input_tokens"][0, 0]) == len(ref.prompt_token_ids)
    assert sum(int(r["num_output_tokens"][0, 0]) for r in responses) == 6
    assert len(responses) == (len(responses) if stream else 1)


def test_stop_words_and_the_trtllm_names_over_http(server, llm):
    ref = llm.greedy("Once upon a time", 8)
    stop = ref.text[len(ref.text) // 2:][:3]
    if not stop.strip():
        pytest.skip("the reference text has no usable stop string")
    events = http_generate(server.http_url, {"text_input": "Once upon a time", "max_tokens": 8, "temperature": 0.0,
                                             "stop_words": [stop], "exclude_input_in_output": True,
                                             "return_finish_reason": True}, stream=False, model=MODEL)
    text = events[0]["text_output"]
    text = text[0] if isinstance(text, list) else text
    assert stop not in text and ref.text.startswith(text) and events[0]["finish_reason"] in ("stop", ["stop"])


def test_beam_width_4_returns_every_beam_best_first(server, llm):
    """TensorRT-LLM's beam search: text_output [batch, beam], output_ids [batch, beam, tokens] (the
    shorter beams padded with -1), the beams those of the in-process engine (token-equal to
    transformers' num_beams: tests/test_beam_search.py)."""
    from backend import SamplingParams

    ref = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=7, temperature=0.0, use_beam_search=True,
                                                                best_of=4, n=4))[0].samples
    inputs = openai_frontend_request("The quick brown fox", False, 7, echo=False)
    inputs["beam_width"] = np.int32([[4]])
    inputs["return_finish_reason"] = np.bool_([[True]])
    (response,) = grpc_stream(server.grpc_url, inputs, model=MODEL)
    assert response["text_output"].shape == (1, 4) and response["output_ids"].shape[:2] == (1, 4)
    assert [t.decode() for t in response["text_output"][0]] == [s.text for s in ref]
    assert [[t for t in row if t >= 0] for row in response["output_ids"][0].tolist()] == [s.token_ids for s in ref]
    assert [r.decode() for r in response["finish_reason"][0]] == [s.finish_reason for s in ref]
    assert len({tuple(s.token_ids) for s in ref}) == 4


@pytest.mark.parametrize("stream", [True, False])
def test_return_log_probs_are_the_engines_logprobs(server, llm, stream):
    """TensorRT-LLM's return_log_probs: cum_log_probs [batch, beam] and output_log_probs [batch,
    beam, tokens] (streaming: the new tokens'), equal to the in-process engine's logprobs of the
    same greedy tokens; cum_log_probs their sum."""
    from backend import SamplingParams

    ref = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=7, temperature=0.0, logprobs=0))[0]
    want = [step[t].logprob for t, step in zip(ref.token_ids, ref.logprobs)]
    inputs = openai_frontend_request("The quick brown fox", stream, 7, echo=False)
    inputs["return_log_probs"] = np.bool_([[True]])
    responses = grpc_stream(server.grpc_url, inputs, model=MODEL)
    assert all(r["cum_log_probs"].shape == (1, 1) and r["output_log_probs"].shape[:2] == (1, 1) for r in responses)
    got = [lp for r in responses for lp in r["output_log_probs"][0, 0].tolist()]
    assert np.concatenate([r["output_ids"].reshape(-1) for r in responses]).tolist() == ref.token_ids
    assert np.allclose(got, want, atol=1e-4, rtol=0)
    assert abs(float(responses[-1]["cum_log_probs"][0, 0]) - sum(got)) < 1e-4
    assert abs(float(responses[-1]["cum_log_probs"][0, 0]) - ref.cumulative_logprob) < 1e-4


def test_return_log_probs_with_beam_width_2_are_per_beam_best_first(server, llm):
    """beam_width 2: cum_log_probs [1, 2] and output_log_probs [1, 2, tokens] (padded with 0 as
    output_ids with -1), best beam first, each the engine's beam's logprobs and their sum."""
    from backend import SamplingParams

    ref = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=7, temperature=0.0, use_beam_search=True,
                                                                best_of=2, n=2, logprobs=0))[0].samples
    inputs = openai_frontend_request("The quick brown fox", False, 7, echo=False)
    inputs.update(return_log_probs=np.bool_([[True]]), beam_width=np.int32([[2]]))
    (response,) = grpc_stream(server.grpc_url, inputs, model=MODEL)
    assert response["cum_log_probs"].shape == (1, 2) and response["output_log_probs"].shape[:2] == (1, 2)
    for beam, s, ids, lps in zip(range(2), ref, response["output_ids"][0].tolist(), response["output_log_probs"][0]):
        n = len(s.token_ids)
        assert [t for t in ids if t >= 0] == s.token_ids
        assert np.allclose(lps[:n], [step[t].logprob for t, step in zip(s.token_ids, s.logprobs)], atol=1e-4, rtol=0)
        assert not lps[n:].any()
        assert abs(float(response["cum_log_probs"][0, beam]) - float(lps.sum())) < 1e-4
    assert np.allclose(response["cum_log_probs"][0], [s.cumulative_logprob for s in ref], atol=1e-4, rtol=0)
    if len(ref[0].token_ids) == len(ref[1].token_ids):  # same length: best first is the higher sum
        assert response["cum_log_probs"][0, 0] > response["cum_log_probs"][0, 1]


@pytest.mark.parametrize("name,value,message", [
    ("beam_width", np.int32([[0]]), "beam_width must be an integer >= 1"),
])
def test_what_we_do_not_support_is_refused_by_name(server, name, value, message):
    inputs = openai_frontend_request("hi", False, 2)
    inputs[name] = value
    with pytest.raises(RuntimeError, match=message):
        grpc_stream(server.grpc_url, inputs, model=MODEL)


def test_llm_itself_refuses_the_batched_shapes_with_tritons_own_message(server):
    """Why llm_trtllm exists: a Triton model fixes the rank of each input."""
    with pytest.raises(Exception, match=r"unexpected shape for input 'text_input'.*Expected \[1\], got \[1,1\]"):
        grpc_stream(server.grpc_url, {"text_input": array("hi", trtllm=True)})


def test_a_cancelled_stream_on_llm_trtllm_stops_the_llm_request(server):
    """The client leaves after the first response: llm_trtllm cancels its BLS request to llm, so
    the engine stops generating long before its 400 tokens."""
    import threading

    import tritonclient.grpc as grpcclient

    from .conftest import wait_until
    from .series import gauge

    generated = gauge(server, "inflight_generation_tokens_total")
    first = threading.Event()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: first.set())
    inputs = []
    for name, value in openai_frontend_request("cancel me", True, 400).items():
        t = grpcclient.InferInput(name, list(value.shape), {"O": "BYTES", "b": "BOOL", "i": "INT32", "f": "FP32",
                                                           "u": "UINT64"}[value.dtype.kind])
        t.set_data_from_numpy(value)
        inputs.append(t)
    inputs.append(grpcclient.InferInput("ignore_eos", [1, 1], "BOOL"))
    inputs[-1].set_data_from_numpy(np.bool_([[True]]))
    client.async_stream_infer(MODEL, inputs)
    assert first.wait(30)
    client.stop_stream(cancel_requests=True)
    client.close()
    wait_until(lambda: gauge(server, "inflight_num_requests_running") == 0, timeout=30)
    assert gauge(server, "inflight_generation_tokens_total") - generated < 200
