"""How `inflight bench` sends the `images` and `embeddings` workloads' requests (workloads.py):

- in-process (`EngineRequests`): each image before the prompt, marked with the model's
  placeholder (Gemma 3's begin-of-image token, Qwen2.5-VL's image pad: docs/vision.md; prompt ids that happen to be an image marker are replaced by
  FIRST_ID, so that a random prompt never claims an image it has not); an embedding as a pooling
  request (docs/pooling.md), whose output is one vector;
- through an OpenAI-compatible port (`openai_chunks`): `/v1/chat/completions` with the images as
  `image_url` data URLs before the text, streamed like completions (one chunk per event with
  text, the final usage's token count); `/v1/embeddings`, one response.

The gRPC and HTTP doors are not driven with them here: their image and embedding inputs are the
Triton model's (docs/vision.md, docs/pooling.md), which `--protocol openai` covers end to end.
"""
from __future__ import annotations

import base64
from typing import Any

from client.tools.benchmarks.workloads import FIRST_ID, WorkItem


class EngineRequests:
    """The in-process engine's prompt and keyword arguments of a work item."""

    def __init__(self, model_path: str, tokenizer):
        from backend.models.gemma3_vision import read_vision_config
        from backend.models.qwen2_5_vl_vision import is_qwen2_5_vl, read_qwen_vision_config
        self.marker_id, self.reserved = None, set()
        if is_qwen2_5_vl(model_path):  # one <|image_pad|> an image (docs/vision.md, Qwen2.5-VL)
            qwen = read_qwen_vision_config(model_path)
            self.marker_id = qwen.image_token_id
            self.reserved = {qwen.image_token_id, qwen.vision_start_token_id, qwen.vision_end_token_id}
        elif (gemma := read_vision_config(model_path)) is not None:  # Gemma 3's <start_of_image>
            self.marker_id = gemma.boi_token_id
            self.reserved = {gemma.boi_token_id, gemma.eoi_token_id, gemma.image_token_id}
        vision = self.marker_id is not None
        self.marker_text = tokenizer.decode([self.marker_id], skip_special_tokens=False) \
            if vision and tokenizer is not None else None

    def prompt(self, item: WorkItem) -> Any:
        if not item.images:
            return item.prompt
        if self.marker_id is None:
            raise ValueError("the images workload needs a vision-language model (its config.json has no vision_config)")
        images = {"image": list(item.images)}
        if isinstance(item.prompt, list):
            ids = [FIRST_ID if t in self.reserved else t for t in item.prompt]
            return {"prompt_token_ids": [self.marker_id] * len(item.images) + ids, "multi_modal_data": images}
        if self.marker_text is None:
            raise ValueError("text prompts with images need the model's tokenizer (for its image marker)")
        return {"prompt": self.marker_text * len(item.images) + item.prompt, "multi_modal_data": images}

    @staticmethod
    def kwargs(item: WorkItem) -> dict[str, Any]:
        if item.kind != "embed":
            return {}
        from backend.core.pooling import PoolingParams
        return {"pooling": PoolingParams()}


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


async def openai_chunks(client, item: WorkItem, *, stream: bool = True, max_tokens: int, temperature: float = 0.0,
                        ignore_eos: bool = True, exclude_input_in_output: bool = True):
    """The responses of one images or embeddings request through an OpenAI port (`client`: the
    bench's OpenAICompletions, its session open)."""
    from client.protocol import Chunk, GenerationError
    from client.tools.benchmarks.targets import chat_text, read_openai_response  # (targets imports this module)
    base, session, model = client.base, client._session, client._model  # (targets.py OpenAICompletions)
    if item.kind == "embed":
        async with session.post(f"{base}/v1/embeddings", json={"model": model, "input": item.prompt}) as r:
            if r.status != 200:
                raise GenerationError(f"HTTP {r.status}: {(await r.text())[:300]}")
            data = await r.json()
        if not data.get("data") or not data["data"][0].get("embedding"):
            raise GenerationError("the response has no embedding")
        yield Chunk("", [], "stop", 0, 0)
        return
    if not isinstance(item.prompt, str):
        raise GenerationError("the images workload through the OpenAI port needs text prompts (--prompt-format text)")
    content = [{"type": "image_url", "image_url": {"url": data_url(png)}} for png in item.images]
    body = {"model": model, "messages": [{"role": "user", "content": [*content, {"type": "text", "text": item.prompt}]}],
            "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        async for chunk in read_openai_response(r, stream, chat_text):
            yield chunk
