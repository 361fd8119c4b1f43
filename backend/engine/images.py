"""A request's images at the engine's front (docs/vision.md), on the caller's thread (never the
engine's): checked, preprocessed, hashed, and their placeholders laid out in the prompt.

A prompt with images is vLLM's shape: `{"prompt": text, "multi_modal_data": {"image": [...]}}` or
`{"prompt_token_ids": [...], "multi_modal_data": ...}`, each image a PIL image or the bytes of a PNG,
JPEG or WebP file. The prompt marks each image's place with Gemma 3's begin-of-image token
(`<start_of_image>`, which its chat template writes for an image part); once tokenized, each marker
token becomes the processor's image sequence, token by token as vLLM does it: the tokens of a blank
line ("\n\n", none without a tokenizer), the marker, `mm_tokens_per_image` image tokens, the
end-of-image token, the blank line again. Qwen2.5-VL's images (dynamic resolution, `<|image_pad|>`)
are laid out by backend/engine/qwen2_5_vl_images.py. Every refusal is a ValueError naming the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

from backend.core.images import ImageProcessing, decode_image, pixel_hash, preprocess
from backend.core.multimodal import ImageItem, expand_placeholders, image_runs, images_per_prompt
from backend.engine.qwen2_5_vl_images import QwenImageFront
from backend.models.gemma3_vision import VisionConfig, read_vision_config
from backend.models.qwen2_5_vl_vision import read_qwen_vision_config


def split_prompt(prompt: Any) -> tuple[Any, list]:
    """(the prompt's text or token ids, its images) of any prompt the engine takes."""
    if not isinstance(prompt, dict):
        return prompt, []
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    if unknown:
        raise ValueError(f"prompt: unknown key {unknown[0]!r} (prompt, prompt_token_ids, multi_modal_data)")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("prompt: give exactly one of prompt (text) and prompt_token_ids")
    text = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or sorted(set(data) - {"image"}):
        raise ValueError("multi_modal_data: only 'image' is supported")
    images = data.get("image", [])
    return text, list(images) if isinstance(images, (list, tuple)) else [images]


class ImageFront:
    """The model's image settings and the engine's limits, applied to one request's images."""

    def __init__(self, model_path: str, config, tokenizer):
        self.vision: Optional[VisionConfig] = read_vision_config(model_path)
        qwen = read_qwen_vision_config(model_path)  # Qwen2.5-VL: its own layout (qwen2_5_vl_images.py)
        self.qwen = QwenImageFront(qwen, model_path, config) if qwen is not None else None
        self.limit = images_per_prompt(config.limit_mm_per_prompt)
        self.encoder_tokens = config.max_num_encoder_input_tokens or config.max_num_batched_tokens
        self.tokenizer = tokenizer
        self.processing = self._processing(Path(model_path)) if self.vision else None
        # the processor's blank line around an image's tokens ("\n\n"), as the tokenizer writes it
        self.blank_line = tokenizer.encode("\n\n", add_special_tokens=False) if tokenizer and self.vision else []

    def _processing(self, folder: Path) -> ImageProcessing:
        """preprocessor_config.json's mean and std (Gemma 3's are 0.5), the tower's square size."""
        path = folder / "preprocessor_config.json"
        cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        mean, std = cfg.get("image_mean", [0.5] * 3), cfg.get("image_std", [0.5] * 3)
        return ImageProcessing(size=self.vision.image_size, mean=tuple(mean), std=tuple(std),
                               rescale=float(cfg.get("rescale_factor", 1 / 255)))

    def check(self, images: Sequence, truncate: Optional[int]) -> None:
        if not images:
            return
        if self.qwen is not None:
            return self.qwen.check(images, truncate)
        if self.vision is None:
            raise ValueError("image: this model takes no images (a text-only checkpoint)")
        if len(images) > self.limit:
            raise ValueError(f"image: {len(images)} images in one prompt; the limit is {self.limit} "
                             f"(limit_mm_per_prompt)")
        if truncate is not None:
            raise ValueError("truncate_prompt_tokens cannot be used with images (it could cut an image's tokens)")
        if self.vision.mm_tokens_per_image > self.encoder_tokens:
            raise ValueError(f"image: an image takes {self.vision.mm_tokens_per_image} tokens, more than a step may "
                             f"encode ({self.encoder_tokens}: max_num_encoder_input_tokens / max_num_batched_tokens)")

    def expand_ids(self, ids: list[int], count: int) -> list[int]:
        """The tokenized prompt with each begin-of-image token expanded (`expand_placeholders`)."""
        v = self.vision
        self._count(ids.count(v.boi_token_id), count, f"<start_of_image> (token {v.boi_token_id})")
        if v.image_token_id in ids:
            raise ValueError(f"prompt: image token {v.image_token_id} appears in the prompt; mark each image with the "
                             f"begin-of-image token {v.boi_token_id} only")
        return expand_placeholders(ids, v.boi_token_id, v.eoi_token_id, v.image_token_id, v.mm_tokens_per_image,
                                   self.blank_line)

    @staticmethod
    def _count(markers: int, images: int, marker: str) -> None:
        if markers != images:
            raise ValueError(f"prompt: {markers} image placeholders ({marker}) for {images} images; give one "
                             "placeholder per image")

    def items(self, ids: Sequence[int], images: Sequence) -> list[ImageItem]:
        """The images' ImageItems over the placeholder runs of the tokenized prompt."""
        v = self.vision
        runs = image_runs(ids, v.image_token_id)
        if len(runs) != len(images) or any(n != v.mm_tokens_per_image for _, n in runs):
            raise ValueError(f"prompt: its image tokens form {len(runs)} runs for {len(images)} images of "
                             f"{v.mm_tokens_per_image} tokens each")
        items = []
        for i, ((offset, length), image) in enumerate(zip(runs, images)):
            pixels = preprocess(as_image(image, f"image[{i}]"), self.processing)
            items.append(ImageItem(pixel_hash(pixels), offset, length, pixels))
        return items

    def lay_out(self, ids: list[int], images: Sequence) -> tuple[list[int], list[ImageItem]]:
        """(the tokenized prompt with its placeholders expanded, the images' ImageItems)."""
        if self.qwen is not None:
            return self.qwen.lay_out(ids, images, as_image)
        ids = self.expand_ids(ids, len(images))
        return ids, self.items(ids, images)


def as_image(image, field: str):
    """A request's image (a PIL image, or a file's bytes decoded here) as a PIL image."""
    if isinstance(image, (bytes, bytearray)):
        return decode_image(bytes(image), field)
    if not hasattr(image, "convert"):
        raise ValueError(f"{field}: an image must be a PIL image or the bytes of a PNG, JPEG or WebP file")
    if 0 in image.size:
        raise ValueError(f"{field}: the image is {image.size[0]}x{image.size[1]}; both sides must be >= 1")
    return image
