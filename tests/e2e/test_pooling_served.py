"""Embeddings through the real tritonserver and the OpenAI server, with the official `openai` SDK
(docs/pooling.md): a tiny Qwen3 embedding checkpoint with sentence-transformers files (last-token
pooling, Normalize) and the default model's tokenizer, served by `runner auto`; vectors equal to the
in-process engine's, base64 as OpenAI encodes it, the bad inputs refused naming the field, chat
refused, and the KV cache back to idle."""
import base64

import numpy as np
import pytest

from serving.openai_launcher import OpenAIServer

from .conftest import requires_tritonserver, wait_until
from .series import gauge

openai = pytest.importorskip("openai")
pytestmark = requires_tritonserver


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, model_path):
    from pooling_models import qwen3_pooling_checkpoint, with_tokenizer

    return with_tokenizer(qwen3_pooling_checkpoint(tmp_path_factory.mktemp("qwen3-embed"), "model", seed=11,
                                                   vocab_size=2000), model_path)


@pytest.fixture(scope="module")
def served(model_repository, embedder):
    from serving.triton_launcher import TritonServer

    params = {"max_model_len": "96", "max_num_batched_tokens": "32", "kv_block_size": "16"}
    with TritonServer(model_repository, params=params, model_path=str(embedder)) as server:
        with OpenAIServer(server.grpc_url, str(embedder)) as api_server:
            yield server, openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _post(url: str, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_embeddings_through_the_sdk(served, embedder):
    from backend import LLM

    server, client = served
    texts = ["Once upon a time there was a tiny model that pooled its last token.", "hello", "a b c d e f g"]
    ids = [7, 300, 41, 1999, 5, 77, 12, 90, 3, 64, 18, 33, 250, 6, 8, 1000, 17]  # 17 tokens: chunked, not a block multiple
    reference = LLM(str(embedder), max_model_len=96)
    want = [o.pooled for o in reference.embed([reference.tokenizer.encode(t) for t in texts] + [ids])]

    out = client.embeddings.create(model="llm", input=texts)
    assert [d.index for d in out.data] == [0, 1, 2]
    for got, exp in zip(out.data, want):
        assert np.allclose(got.embedding, exp, atol=1e-5) and abs(np.linalg.norm(got.embedding) - 1) < 1e-5
    assert out.usage.prompt_tokens == sum(len(reference.tokenizer.encode(t)) for t in texts)

    as_ids = client.embeddings.create(model="llm", input=[ids], encoding_format="float")
    assert np.allclose(as_ids.data[0].embedding, want[3], atol=1e-5) and as_ids.usage.prompt_tokens == 17
    # base64: little-endian float32, as OpenAI encodes it (the SDK's own default asks for it and decodes)
    raw = client.embeddings.with_raw_response.create(model="llm", input="hello", encoding_format="base64").http_response
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vector, want[1], atol=1e-5)
    cut = client.embeddings.create(model="llm", input=[list(range(3, 103))], extra_body={"truncate_prompt_tokens": 40})
    assert cut.usage.prompt_tokens == 40

    for kwargs, param, words in ((dict(input=""), "input", "empty"), (dict(input=["a", ""]), "input", "input[1]"),
                                 (dict(input="hi", dimensions=16), None, "Matryoshka"),
                                 (dict(input=[list(range(3, 103))]), None, "max_model_len is 96"),
                                 (dict(input="hi", encoding_format="int8"), "encoding_format", "float or base64")):
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model="llm", **kwargs)
        assert words in err.value.message and (param is None or err.value.param == param)
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.completions.create(model="llm", prompt="Hi", max_tokens=2)
    assert client.embeddings.create(model="llm", input="still serving").data[0].embedding  # the server stays up
    wait_until(lambda: gauge(server, "inflight_kv_blocks", state="used") == 0, timeout=10)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, model_path):
    from pooling_models import qwen3_pooling_checkpoint, with_tokenizer

    return with_tokenizer(qwen3_pooling_checkpoint(tmp_path_factory.mktemp("qwen3-rerank"), "classify", seed=14,
                                                   vocab_size=2000), model_path)


def test_rerank_and_score_through_the_server(model_repository, reranker):
    """/v1/rerank and /v1/score on a cross-encoder: each pair tokenized as the tokenizer encodes a pair,
    scores equal to transformers' sigmoid of the score head, results best first, top_n kept."""
    from pooling_models import hf_scores
    from serving.triton_launcher import TritonServer
    from backend.text.tokenizer import Tokenizer

    query = "capital of France"
    documents = ["Paris is the capital.", "Bananas are yellow.", "France is in Europe, and Paris is its capital city."]
    tok = Tokenizer.from_dir(reranker)
    expected = hf_scores(reranker, [tok.backend.encode(query, d).ids for d in documents])
    with TritonServer(model_repository, params={"max_model_len": "96"}, model_path=str(reranker)) as server:
        with OpenAIServer(server.grpc_url, str(reranker)) as api_server:
            status, body = _post(api_server.url + "/v1/rerank",
                                 {"model": "llm", "query": query, "documents": documents, "top_n": 2})
            assert status == 200, body
            results = body["results"]
            best = sorted(range(3), key=lambda i: -expected[i])[:2]
            assert [x["index"] for x in results] == best
            assert [x["relevance_score"] for x in results] == pytest.approx([expected[i] for i in best], abs=1e-5)
            assert results[0]["document"]["text"] == documents[best[0]]
            _, s = _post(api_server.url + "/v1/score", {"model": "llm", "text_1": query, "text_2": documents})
            assert [d["score"] for d in s["data"]] == pytest.approx(expected, abs=1e-5)
            status, refused = _post(api_server.url + "/v1/embeddings", {"model": "llm", "input": "hi"})
            assert status == 400 and "pooling_task" in refused["error"]["message"]
            status, refused = _post(api_server.url + "/v1/rerank", {"model": "llm", "query": "", "documents": ["a"]})
            assert status == 400 and refused["error"]["param"] == "query"
            wait_until(lambda: gauge(server, "inflight_kv_blocks", state="used") == 0, timeout=10)
