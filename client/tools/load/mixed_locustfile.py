"""Locust's mixed load of issue 44: chat with images, text-only chat and embeddings at once on one
tritonserver that serves a vision model as `llm` and an embedding model as `embed` (docs/vision.md,
"A mixed load"). Every user posts to Triton's HTTP `generate` endpoint:

  - `ImageChatUser` ("chat+image"): a prompt with one or two image tokens and as many PNGs (seeded
    random pixels, 20-900 pixels a side) in the `image` input (base64, the vLLM backend's input);
  - `TextChatUser` ("chat"): a text-only prompt;
  - `EmbedUser` ("embed"): a sentence to the embedding model; its answer must carry an `embedding`.

A request fails on an HTTP error, an error in the answer, a chat answer without a finish reason or
an embedding without its vector, so `locust --headless` exits non-zero on any failure. After a run,
the metrics (port 8002) should show the KV cache, the queue and the encoder cache back to idle.

    locust -f client/tools/load/mixed_locustfile.py --headless -u 12 -r 4 -t 60s --host http://localhost:8000

Settings (environment):
  INFLIGHT_EMBED_MODEL   the embedding model's name in the repository (default embed)
  INFLIGHT_IMAGE_TOKEN   the vision model's image marker in a text prompt (default <start_of_image>)
  INFLIGHT_MAX_TOKENS    each chat answer's length (default 32)
"""
from __future__ import annotations

import base64
import io
import os
import random

from locust import HttpUser, between, events, task

from client.tools.load.locust_common import finish_reason, json_answer

EMBED_MODEL = os.environ.get("INFLIGHT_EMBED_MODEL", "embed")
IMAGE_TOKEN = os.environ.get("INFLIGHT_IMAGE_TOKEN", "<start_of_image>")
MAX_TOKENS = int(os.environ.get("INFLIGHT_MAX_TOKENS", "32"))
WORDS = "the a tiny model reads pictures and sentences under load while its cache stays bounded".split()
_rng = random.Random(44)


def _png(seed: int) -> str:
    from PIL import Image
    rng = random.Random(seed)
    width, height = rng.randrange(20, 900), rng.randrange(20, 900)
    pixels = bytes(rng.getrandbits(8) for _ in range(16 * 16 * 3))
    image = Image.frombytes("RGB", (16, 16), pixels).resize((width, height))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


IMAGES = [_png(seed) for seed in range(8)]  # a few distinct images: the encoder cache gets hits and misses


def _sentence(low: int, high: int) -> str:
    return " ".join(_rng.choice(WORDS) for _ in range(_rng.randrange(low, high)))


def _check(response, want: str) -> None:
    """Mark the response: `want` is "text" (a finished chat answer) or "embedding"."""
    data = json_answer(response)
    if data is None:
        return
    if "error" in data:
        response.failure(f"error: {str(data)[:200]}")
    elif want == "embedding" and not data.get("embedding"):
        response.failure(f"no embedding: {str(data)[:200]}")
    elif want == "text" and finish_reason(data) in (None, "", "abort", "error"):
        response.failure(f"no finish reason: {str(data)[:200]}")
    else:
        response.success()


def _chat(user: HttpUser, images: list[str], name: str) -> None:
    prompt = " ".join([_sentence(2, 8), *([IMAGE_TOKEN] * len(images)), _sentence(1, 12)])
    body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "exclude_input_in_output": True,
            "return_finish_reason": True}  # sent only when asked (the vLLM backend's contract)
    if images:
        body["image"] = images
    with user.client.post("/v2/models/llm/generate", json=body, name=name, catch_response=True) as r:
        _check(r, "text")


class ImageChatUser(HttpUser):
    wait_time = between(0.0, 0.2)
    weight = 2

    @task
    def chat_with_images(self) -> None:
        _chat(self, _rng.sample(IMAGES, _rng.choice((1, 1, 2))), "chat+image")


class TextChatUser(HttpUser):
    wait_time = between(0.0, 0.2)
    weight = 1

    @task
    def chat(self) -> None:
        _chat(self, [], "chat")


class EmbedUser(HttpUser):
    wait_time = between(0.0, 0.2)
    weight = 2

    @task
    def embed(self) -> None:
        with self.client.post(f"/v2/models/{EMBED_MODEL}/generate", json={"text_input": _sentence(3, 30)},
                              name="embed", catch_response=True) as r:
            _check(r, "embedding")


@events.quitting.add_listener
def _fail_on_errors(environment, **_kw) -> None:
    """Exit non-zero on any failed request."""
    if environment.stats.total.num_failures > 0:
        environment.process_exit_code = 1
