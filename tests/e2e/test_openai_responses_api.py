"""API keys, Triton's restricted APIs, /tokenize and /detokenize, and /v1/responses through the
real servers, as `inflight serve` starts them, asked with the official `openai` SDK. One server
for all: the tiny random Qwen3 in Qwen3's chat format (tests/qwen3_chat.py), `--api-key` with two
keys, Triton's repository and statistics APIs behind a header (`--triton-arg`)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from serving.triton_launcher import free_port

from .conftest import inflight_serve, requires_tritonserver, stop_serve

openai = pytest.importorskip("openai")
pytestmark = requires_tritonserver

KEY, OTHER_KEY = "sk-inflight-test", "second-key"
ADMIN = ("admin-key", "s3cret")


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_repository):
    from backend.text.tokenizer import Tokenizer
    from qwen3_chat import make_qwen3_chat

    path = make_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat"))
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    restricted = f"model-repository,statistics:{ADMIN[0]}={ADMIN[1]}"
    proc, _ = inflight_serve(
        ["--model-repository", str(model_repository), "--model-path", str(path), "--host", "127.0.0.1",
         "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
         "--metrics-port", str(ports["metrics"]), "--openai-port", str(ports["openai"]),
         "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--api-key", KEY, OTHER_KEY,
         f"--triton-arg=--http-restricted-api={restricted}", f"--triton-arg=--grpc-restricted-protocol={restricted}",
         "--param", "max_model_len=512", "--param", "max_num_seqs=8", "--param", "cpu_kv_cache_tokens=8192"],
        timeout=300)
    try:
        yield {"url": f"http://127.0.0.1:{ports['openai']}", "tokenizer": Tokenizer.from_dir(path),
               "http": f"127.0.0.1:{ports['http']}", "grpc": f"127.0.0.1:{ports['grpc']}"}
    finally:
        stop_serve(proc)


def sdk(served, key=KEY):
    return openai.OpenAI(base_url=f"{served['url']}/v1", api_key=key, max_retries=0, timeout=120)


def get(url: str, headers: dict | None = None, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# -- keys --------------------------------------------------------------------------------------------

def test_the_key_is_wanted_on_v1_and_health_and_metrics_stay_open(served):
    for key in ("not-the-key", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as err:
            sdk(served, key).models.list()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    no_key = openai.OpenAI(base_url=f"{served['url']}/v1", api_key="unused", max_retries=0,
                           default_headers={"Authorization": ""})  # the SDK sends no key
    with pytest.raises(openai.AuthenticationError):
        no_key.models.list()
    assert [m.id for m in sdk(served).models.list().data] == ["llm"]
    assert [m.id for m in sdk(served, OTHER_KEY).models.list().data] == ["llm"]
    status, body = get(f"{served['url']}/v1/chat/completions", data=b"{}")
    assert status == 401 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert get(f"{served['url']}/metrics")[0] == 200
    assert get(f"{served['url']}/health")[0] == 200


def test_tritons_restricted_apis_want_their_header(served):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    index = f"http://{served['http']}/v2/repository/index"
    assert get(index, data=b"{}")[0] == 403
    status, body = get(index, headers={ADMIN[0]: ADMIN[1]}, data=b"{}")
    assert status == 200 and "llm" in body.decode()
    assert get(f"http://{served['http']}/v2/models/llm/ready")[0] == 200  # health stays open
    client = grpcclient.InferenceServerClient(served["grpc"])
    with pytest.raises(InferenceServerException):
        client.get_inference_statistics("llm")
    assert client.get_inference_statistics(  # gRPC: the header name gets a prefix
        "llm", headers={f"triton-grpc-protocol-{ADMIN[0]}": ADMIN[1]}, as_json=True)["model_stats"]
    assert client.is_model_ready("llm")


# -- /tokenize and /detokenize ---------------------------------------------------------------------

def post(served, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    status, raw = get(f"{served['url']}{path}", headers={"Authorization": f"Bearer {key}"} if key else {},
                      data=json.dumps(body).encode())
    return status, json.loads(raw)


def test_tokenize_and_detokenize_round_trip_as_the_tokenizer(served):
    tokenizer, text = served["tokenizer"], "Is it sunny in Paris? <think> maybe"
    status, got = post(served, "/tokenize", {"model": "llm", "prompt": text})
    assert status == 200 and got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 512  # the served --param
    status, back = post(served, "/detokenize", {"model": "llm", "tokens": got["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.decode(got["tokens"], skip_special_tokens=False)}
    status, bare = post(served, "/tokenize", {"model": "llm", "prompt": text, "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False) != got["tokens"]  # no BOS
    assert post(served, "/detokenize", {"tokens": bare["tokens"]}) == (200, {"prompt": text})
    # a chat: the prompt /v1/chat/completions would send (its usage counts the same tokens)
    ask = [{"role": "user", "content": "Hi"}]
    status, chat = post(served, "/tokenize", {"messages": ask, "chat_template_kwargs": {"enable_thinking": False},
                                              "return_token_strs": True})
    expected = tokenizer.encode(tokenizer.render_chat(ask, enable_thinking=False), add_special_tokens=False)
    assert status == 200 and chat["tokens"] == expected
    assert chat["token_strs"] == [tokenizer.id_to_token(i) for i in expected]
    used = sdk(served).chat.completions.create(model="llm", messages=ask, max_tokens=1,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert used.usage.prompt_tokens == chat["count"]
    # refusals name the field; no key: 401
    assert post(served, "/detokenize", {"tokens": [10 ** 9]})[1]["error"]["param"] == "tokens"
    assert post(served, "/tokenize", {"prompt": "x", "messages": ask})[0] == 400
    assert post(served, "/tokenize", {"prompt": "x"}, key=None)[0] == 401
    assert post(served, "/detokenize", {"tokens": [1]}, key="wrong")[0] == 401
