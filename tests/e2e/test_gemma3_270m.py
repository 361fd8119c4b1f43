"""Gemma 3 270M (Google's base model, Q4_K_M GGUF from the package index, imported packed) served
end to end the `make serve MODEL=gemma3-270m` way: `inflight serve --model-path models/gemma3-270m`
starts tritonserver and the OpenAI server; Triton's generate and `/v1/completions` (the openai SDK)
answer the same greedy text, which knows the capital of France (" The capital of France is Paris.").
Skipped, saying so, only when the package index is unreachable (tests/gemma3.py)."""
import json
import urllib.request

import pytest

from serving.triton_launcher import free_port

from .conftest import inflight_serve, requires_tritonserver, stop_serve

openai = pytest.importorskip("openai")
pytestmark = requires_tritonserver

PROMPT, MAX_TOKENS = "Q: What is the capital of France?\nA:", 8


@pytest.fixture(scope="module")
def served(model_repository):
    from gemma3 import gemma3_dir

    path = gemma3_dir()
    http, api = free_port(), free_port()
    proc, lines = inflight_serve(
        ["--model-repository", str(model_repository), "--model-path", str(path), "--host", "127.0.0.1",
         "--http-port", str(http), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
         "--openai-port", str(api), "--param", "max_model_len=1024", "--param", "cpu_kv_cache_tokens=4096"])
    try:
        yield path, f"http://127.0.0.1:{http}", f"http://127.0.0.1:{api}/v1", "".join(lines)
    finally:
        stop_serve(proc)


def test_triton_generate_and_v1_completions_answer_the_same(served):
    from backend.text.tokenizer import Tokenizer

    path, http, api, log = served
    assert "gguf (" in log and "Q4_K" in log, "the weights were not kept packed"  # the load's summary
    body = json.dumps({"text_input": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "exclude_input_in_output": True, "return_num_output_tokens": True}).encode()
    request = urllib.request.Request(f"{http}/v2/models/llm/generate", body, {"Content-Type": "application/json"})
    triton = json.loads(urllib.request.urlopen(request, timeout=300).read())
    assert "Paris" in triton["text_output"], triton

    client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=300)
    completion = client.completions.create(model="llm", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert completion.choices[0].text == triton["text_output"]
    assert completion.usage.completion_tokens == int(triton["num_output_tokens"]) == MAX_TOKENS
    assert completion.usage.prompt_tokens == len(Tokenizer.from_dir(path).encode(PROMPT))  # BOS included
