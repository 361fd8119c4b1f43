"""The requests of clients written for Triton's vLLM backend, built exactly as they build them,
against our server with only the model name changed: its samples/client.py (one asyncio gRPC
stream, the sampling settings both as the sampling_parameters tensor and as request parameters),
its CI tests (request parameters only), Triton's OpenAI frontend (the vLLM request format) and
genai-perf (its vLLM and TensorRT-LLM converters, shaped by our config's dims as perf_analyzer
does). No code of theirs is vendored: the requests are rebuilt from their documented shapes."""
import asyncio
import json

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio

from .conftest import requires_tritonserver
from .raw_requests import array, grpc_stream, http_generate

pytestmark = requires_tritonserver

# samples/prompts.txt of the vLLM backend, read with readlines() (the newline stays)
PROMPTS = ["Hello, my name is\n", "The most dangerous animal is\n", "The capital of France is\n",
           "The future of AI is\n"]


def sample_client_request(prompt, request_id, sampling, stream=False, exclude_input_in_output=False):
    """samples/client.py create_request(): text_input, stream, sampling_parameters (JSON),
    exclude_input_in_output, text_output requested, and the same settings as `parameters`."""
    inputs = []
    for name, value, wire in (("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
                              ("stream", np.array([stream], dtype=bool), "BOOL"),
                              ("sampling_parameters", np.array([json.dumps(sampling).encode("utf-8")],
                                                               dtype=np.object_), "BYTES"),
                              ("exclude_input_in_output", np.array([exclude_input_in_output], dtype=bool), "BOOL")):
        inputs.append(grpcaio.InferInput(name, [1], wire))
        inputs[-1].set_data_from_numpy(value)
    return {"model_name": "llm", "inputs": inputs, "outputs": [grpcaio.InferRequestedOutput("text_output")],
            "request_id": str(request_id), "parameters": sampling}


async def run_sample_client(url, sampling, stream=False):
    """samples/client.py process_stream(): every prompt on one stream, text_output gathered by id.
    `sampling`: one dict for every prompt, or a list of one per prompt."""
    results = {str(i): [] for i in range(len(PROMPTS))}
    errors = []

    async def requests():
        for i, prompt in enumerate(PROMPTS):
            yield sample_client_request(prompt, i, sampling[i] if isinstance(sampling, list) else sampling, stream,
                                        exclude_input_in_output=stream)

    client = grpcaio.InferenceServerClient(url=url)
    try:
        async for result, error in client.stream_infer(inputs_iterator=requests(), stream_timeout=120):
            if error:
                errors.append(error)
            else:
                results[result.get_response().id].extend(result.as_numpy("text_output"))
    finally:
        await client.close()
    return results, errors


def test_the_sample_clients_requests_succeed(server):
    sampling = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}  # as samples/client.py run()
    results, errors = asyncio.run(run_sample_client(server.grpc_url, sampling))
    assert errors == []
    for i, prompt in enumerate(PROMPTS):
        assert len(results[str(i)]) == 1  # not streaming: one answer, the prompt in front
        text = results[str(i)][0].decode("utf-8")
        assert text.startswith(prompt) and len(text) > len(prompt)


def test_the_sample_client_streaming_and_greedy_matches_the_engine(server, llm):
    sampling = {"temperature": "0", "max_tokens": "12", "ignore_eos": "true"}
    results, errors = asyncio.run(run_sample_client(server.grpc_url, sampling, stream=True))
    assert errors == []
    for i, prompt in enumerate(PROMPTS):
        assert b"".join(results[str(i)]).decode("utf-8") == llm.greedy(prompt, 12).text


def test_request_parameters_alone_set_the_sampling_as_in_the_vllm_backend_ci(server, llm):
    """Its CI tests send the settings only as gRPC `parameters=` (no sampling_parameters tensor)."""
    responses = grpc_stream(server.grpc_url, {"text_input": array("The capital of France is"),
                                              "stream": array(False), "exclude_input_in_output": array(True)},
                            parameters={"temperature": "0", "max_tokens": "7", "ignore_eos": "true"})
    assert [r["text_output"][0].decode() for r in responses] == [llm.greedy("The capital of France is", 7).text]
    with pytest.raises(RuntimeError, match="unknown input.s. or sampling key.s. 'max_token'"):
        grpc_stream(server.grpc_url, {"text_input": array("x")}, parameters={"max_token": "7"})


def test_the_openai_frontends_vllm_request_format(server, llm):
    """engine/utils/triton.py _create_vllm_generate_request: the OpenAI request's fields (with
    their defaults: n, temperature, top_p, penalties) as sampling_parameters, return_logprobs,
    exclude_input_in_output (echo), and the two token counts it reads for `usage`."""
    sampling = {"frequency_penalty": 0.0, "n": 1, "presence_penalty": 0.0, "temperature": 0.0, "top_p": 1.0,
                "ignore_eos": True, "max_tokens": 6, "logprobs": 2}
    inputs = {"return_logprobs": np.bool_([True]), "text_input": np.array([b"Hello world"], dtype=np.object_),
              "stream": np.bool_([True]), "exclude_input_in_output": np.bool_([True]),
              "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
              "return_num_input_tokens": np.bool_([True]), "return_num_output_tokens": np.bool_([True])}
    responses = grpc_stream(server.grpc_url, inputs)
    ref = llm.greedy("Hello world", 6)
    assert "".join(r["text_output"][0].decode() for r in responses) == ref.text
    assert sum(int(r["num_output_tokens"][0]) for r in responses) == 6  # usage.completion_tokens
    assert int(responses[0]["num_input_tokens"][0]) == len(ref.prompt_token_ids)
    steps = sum((json.loads(r["logprobs"][0]) for r in responses), [])
    assert len(steps) == 6 and all(len(s) in (2, 3) for s in steps)  # the sampled token and the top 2


@pytest.mark.parametrize("stream", [True, False])
def test_genai_perfs_vllm_and_tensorrt_llm_converters_at_the_configs_shapes(server, llm, stream):
    """genai-perf's converters write the payload; perf_analyzer shapes it by the model config
    ([1] here). vLLM: sampling_parameters with string values and min_tokens; TensorRT-LLM:
    max_tokens and min_length tensors."""
    vllm = {"text_input": ["Once upon a time"], "exclude_input_in_output": [True], "stream": [stream],
            "sampling_parameters": [json.dumps({"max_tokens": "5", "min_tokens": "5"})]}
    trtllm = {"text_input": ["Once upon a time"], "max_tokens": [5], "exclude_input_in_output": [True],
              "stream": [stream], "min_length": [5]}
    for payload in (vllm, trtllm):
        body = {k: v[0] for k, v in payload.items()}
        events = http_generate(server.http_url, body, stream)
        text = "".join(e["text_output"] if isinstance(e["text_output"], str) else e["text_output"][0] for e in events)
        assert len(sum(([e["output_ids"]] if isinstance(e["output_ids"], int) else e["output_ids"]
                        for e in events), [])) == 5 and text
