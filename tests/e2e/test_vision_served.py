"""Gemma 3 vision served by a real tritonserver (docs/vision.md): the vLLM backend's `image` input
(base64 strings) with token and text prompts, and the official openai SDK's `image_url` data URLs
through the OpenAI server; their answers equal the in-process engine's on the same checkpoint (which
equals transformers: tests/test_vision_gemma3.py). Refusals (a corrupt image, too many, a GIF, an
http or file URL the operator did not allow, an image to a text-only model) are 400s naming the
field, and the server keeps serving; the encoder metrics count one run for an image sent twice."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from serving.openai_launcher import OpenAIServer

from .conftest import cpu_repository, grpc_error, requires_tritonserver, wait_until
from .raw_requests import grpc_stream
from .series import gauge

pytestmark = requires_tritonserver
openai = pytest.importorskip("openai")

MAX_TOKENS = 6
BOI = 2000  # the tokenizer's <start_of_image> (tests/vision_checkpoint.py)


@pytest.fixture(scope="module")
def vision_setup(tmp_path_factory):
    from vision_checkpoint import make_vision_checkpoint

    return make_vision_checkpoint(tmp_path_factory.mktemp("vision-served"), seed=3, tokenizer=True)


@pytest.fixture(scope="module")
def vision_server(vision_setup, tmp_path_factory):
    from serving.triton_launcher import TritonServer

    repo = tmp_path_factory.mktemp("vision-repo")
    cpu_repository(repo)
    params = {"max_model_len": "512", "limit_mm_per_prompt": "2", "cpu_kv_cache_tokens": "4096"}
    with TritonServer(repo, params=params, model_path=str(vision_setup)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(vision_setup):
    from backend import LLM, SamplingParams

    llm = LLM(str(vision_setup), max_model_len=512)

    def greedy(prompt, images):
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        out = llm.generate([{key: prompt, "multi_modal_data": {"image": images}}],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
        return out.token_ids, out.text
    return greedy


def png(seed, width, height, fmt="PNG"):
    from vision_checkpoint import image_bytes, random_image
    return image_bytes(random_image(seed, width, height), fmt)


def tensors(prompt, images):
    out = {"image": np.array([base64.b64encode(b) for b in images], dtype=np.object_),
           "max_tokens": np.array([MAX_TOKENS], dtype=np.int32), "temperature": np.array([0.0], dtype=np.float32),
           "ignore_eos": np.array([True]), "exclude_input_in_output": np.array([True])}
    if isinstance(prompt, str):
        out["text_input"] = np.array([prompt.encode()], dtype=np.object_)
    else:
        out["input_ids"] = np.array(prompt, dtype=np.int32)
    return out


def wire(named):
    """grpc_error's form: (name, array, Triton datatype)."""
    kinds = {"O": "BYTES", "i": "INT32", "f": "FP32", "b": "BOOL"}
    return [(k, v, kinds[v.dtype.kind]) for k, v in named.items()]


def test_the_image_input_with_token_and_text_prompts(vision_server, reference):
    images = [png(1, 30, 40), png(2, 64, 20)]
    ids = [5, 6, BOI, 7, BOI, 8]
    got = grpc_stream(vision_server.grpc_url, tensors(ids, images))
    assert got[-1]["output_ids"].tolist() == reference(ids, images)[0]
    text = "A picture <start_of_image> and its words"
    got = grpc_stream(vision_server.grpc_url, tensors(text, images[:1]))
    assert got[-1]["text_output"][0].decode() == reference(text, images[:1])[1]
    for bad, words in [(tensors(ids, [b"\x89PNG not really", images[1]]), "image[0]: not a PNG"),
                       (tensors([5, BOI, BOI, BOI], images + images[:1]), "the limit is 2 (limit_mm_per_prompt)"),
                       (tensors([5, BOI], [png(3, 8, 8, "GIF")]), "image[0]: not a PNG, JPEG or WebP")]:
        assert words in grpc_error(vision_server, wire(bad))
    wait_until(lambda: gauge(vision_server, "inflight_kv_blocks", state="used") == 0, timeout=10)
    runs = gauge(vision_server, "inflight_encoder_runs_total")
    assert grpc_stream(vision_server.grpc_url, tensors(ids, images))[-1]["output_ids"].tolist() == \
        reference(ids, images)[0]
    assert gauge(vision_server, "inflight_encoder_runs_total") == runs  # the same two images: no new run
    assert gauge(vision_server, "inflight_encoder_cache_bytes") > 0


def test_the_openai_sdk_with_image_url_data_urls(vision_server, vision_setup, reference):
    image = png(4, 50, 30)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    with OpenAIServer(vision_server.grpc_url, vision_setup) as api_server:
        api = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        out = api.chat.completions.create(model="llm", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        from openai_server.chat_render import ChatRenderer  # the ids the OpenAI server sends (its chat template)
        ids = ChatRenderer(str(vision_setup))([{"role": "user", "content": "What is this?<start_of_image>"}])
        assert ids.count(BOI) == 1
        assert out.choices[0].message.content == reference(ids, [image])[1]
        for bad_url, words in [("https://example.com/cat.png", "--allowed-media-domains"),
                               ("file:///etc/passwd", "--allowed-local-media-path"),
                               ("data:image/gif;base64,R0lGODlh", "unsupported image type 'image/gif'")]:
            part = {"type": "image_url", "image_url": {"url": bad_url}}
            with pytest.raises(openai.BadRequestError, match=words) as info:
                api.chat.completions.create(model="llm", messages=[{"role": "user", "content": [part]}], max_tokens=2)
            assert info.value.body["param"].startswith("messages[0].content[0].image_url")
        again = api.chat.completions.create(model="llm", messages=[{"role": "user", "content": content}],
                                            max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].message.content == out.choices[0].message.content


def test_an_image_to_the_text_only_server_is_refused(server, model_path):
    assert "this model takes no images" in grpc_error(server, wire(tensors([5, 6], [png(5, 9, 9)])))
    with OpenAIServer(server.grpc_url, model_path) as api_server:
        api = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            api.chat.completions.create(model="llm", messages=[{"role": "user", "content": [part]}], max_tokens=2)
