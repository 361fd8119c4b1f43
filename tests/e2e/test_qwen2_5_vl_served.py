"""Qwen2.5-VL served by a real tritonserver (docs/vision.md): the vLLM backend's `image` input
(base64) with a token prompt, and the official openai SDK's `image_url` data URLs through the OpenAI
server (its chat template writes <|vision_start|><|image_pad|><|vision_end|> for the image part);
both answers equal the in-process engine's on the same checkpoint, which equals transformers
(tests/test_qwen2_5_vl.py). Images of different sizes, none a multiple of 28 (of 8 here); a bad
image is a 400 naming the field and the server keeps serving."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from serving.openai_launcher import OpenAIServer

from .conftest import MODEL_DIR, grpc_error, requires_tritonserver
from .raw_requests import grpc_stream

pytestmark = requires_tritonserver
openai = pytest.importorskip("openai")

MAX_TOKENS = 6
START, END, PAD = 2000, 2001, 2002  # the tokenizer's <|vision_start|>, <|vision_end|>, <|image_pad|>


@pytest.fixture(scope="module")
def qwen_setup(tmp_path_factory):
    from qwen2_5_vl import make_qwen2_5_vl_checkpoint

    return make_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen-vl-served"), seed=4, tokenizer=True)


@pytest.fixture(scope="module")
def qwen_server(qwen_setup, tmp_path_factory):
    from serving.triton_launcher import TritonServer
    from templates.render import write_config

    repo = tmp_path_factory.mktemp("qwen-vl-repo")
    write_config(repo / "llm" / "config.pbtxt", gpus=[])
    (repo / "llm" / "1").symlink_to(MODEL_DIR, target_is_directory=True)
    params = {"max_model_len": "512", "limit_mm_per_prompt": "2", "cpu_kv_cache_tokens": "4096"}
    with TritonServer(repo, params=params, model_path=str(qwen_setup)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(qwen_setup):
    from backend import LLM, SamplingParams

    llm = LLM(str(qwen_setup), max_model_len=512)

    def greedy(ids, images):
        out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
        return out.token_ids, out.text
    return greedy


def png(seed, width, height):
    from vision_checkpoint import image_bytes, random_image
    return image_bytes(random_image(seed, width, height))


def tensors(ids, images):
    return {"image": np.array([base64.b64encode(b) for b in images], dtype=np.object_),
            "input_ids": np.array(ids, dtype=np.int32), "max_tokens": np.array([MAX_TOKENS], dtype=np.int32),
            "temperature": np.array([0.0], dtype=np.float32), "ignore_eos": np.array([True]),
            "exclude_input_in_output": np.array([True])}


def test_the_image_input_and_the_openai_sdk(qwen_server, qwen_setup, reference):
    images = [png(1, 30, 41), png(2, 66, 21)]
    ids = [5, 6, START, PAD, END, 7, START, PAD, END, 8]
    got = grpc_stream(qwen_server.grpc_url, tensors(ids, images))
    assert got[-1]["output_ids"].tolist() == reference(ids, images)[0]
    bad = tensors([5, PAD], [b"\x89PNG not really"])
    kinds = {"O": "BYTES", "i": "INT32", "f": "FP32", "b": "BOOL"}
    assert "image[0]: not a PNG" in grpc_error(qwen_server, [(k, v, kinds[v.dtype.kind]) for k, v in bad.items()])

    url = "data:image/png;base64," + base64.b64encode(images[1]).decode()
    with OpenAIServer(qwen_server.grpc_url, qwen_setup) as api_server:
        api = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        out = api.chat.completions.create(model="llm", messages=[{"role": "user", "content": content}],
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        from openai_server.chat_render import ChatRenderer  # the ids the OpenAI server sends (its chat template)
        chat_ids = ChatRenderer(str(qwen_setup))([{"role": "user", "content":
                                                   "What is this?<|vision_start|><|image_pad|><|vision_end|>"}])
        assert chat_ids.count(PAD) == 1 and chat_ids.count(START) == 1
        assert out.choices[0].message.content == reference(chat_ids, [images[1]])[1]
