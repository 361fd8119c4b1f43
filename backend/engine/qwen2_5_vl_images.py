"""Qwen2.5-VL's images at the engine's front (docs/vision.md): dynamic resolution and the prompt's
placeholders, on the caller's thread, as transformers' Qwen2_5_VLProcessor prepares them.

Each image is resized (PIL bicubic, transformers' Qwen2VLImageProcessorPil) to the sides
`smart_resize` picks: the nearest multiples of patch x merge pixels (28) keeping the aspect ratio,
scaled to hold between `min_pixels` and `max_pixels` (preprocessor_config.json: min_pixels and
max_pixels, or size.shortest_edge and size.longest_edge), then rescaled and normalized (CLIP's mean
and std unless the file gives others). Its tokens are its merged patches: (height / 28) x (width / 28).
The prompt marks each image with one `<|image_pad|>` token (the chat template writes
`<|vision_start|><|image_pad|><|vision_end|>` for an image part); each becomes that many pads, as the
processor expands it. Refusals are ValueErrors naming the field.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

from backend.core.images import ImageProcessing, pixel_hash, preprocess
from backend.core.multimodal import ImageItem, images_per_prompt
from backend.models.qwen2_5_vl_vision import QwenVisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN / _STD
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2VLImageProcessor's defaults
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, field: str) -> tuple[int, int]:
    """(height, width) multiples of `factor`, the aspect ratio kept as near as may be, the area
    within [min_pixels, max_pixels] (transformers' smart_resize)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"{field}: the image is {width}x{height}; its aspect ratio must be at most "
                         f"{MAX_ASPECT_RATIO} (Qwen2.5-VL's processor)")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class QwenImageFront:
    """A Qwen2.5-VL checkpoint's image settings and the engine's limits, applied to one request."""

    def __init__(self, vision: QwenVisionConfig, model_path: str, config):
        self.vision = vision
        self.limit = images_per_prompt(config.limit_mm_per_prompt)
        self.encoder_tokens = config.max_num_encoder_input_tokens or config.max_num_batched_tokens
        path = Path(model_path) / "preprocessor_config.json"
        cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        self.min_pixels = _count(cfg.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS, "min_pixels")
        self.max_pixels = _count(cfg.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS, "max_pixels")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"preprocessor_config.json: min_pixels {self.min_pixels} is above max_pixels "
                             f"{self.max_pixels}")
        for key, want in (("patch_size", vision.patch_size), ("merge_size", vision.spatial_merge_size),
                          ("temporal_patch_size", vision.temporal_patch_size)):
            if cfg.get(key, want) != want:
                raise ValueError(f"preprocessor_config.json: {key} is {cfg[key]!r}; the vision config has {want}")
        self.processing = ImageProcessing(size=0, mean=tuple(cfg.get("image_mean", CLIP_MEAN)),
                                          std=tuple(cfg.get("image_std", CLIP_STD)),
                                          rescale=float(cfg.get("rescale_factor", 1 / 255)), resample="BICUBIC")

    def check(self, images: Sequence, truncate: Optional[int]) -> None:
        if not images:
            return
        if len(images) > self.limit:
            raise ValueError(f"image: {len(images)} images in one prompt; the limit is {self.limit} "
                             f"(limit_mm_per_prompt)")
        if truncate is not None:
            raise ValueError("truncate_prompt_tokens cannot be used with images (it could cut an image's tokens)")

    def lay_out(self, ids: list[int], images: Sequence, as_image) -> tuple[list[int], list[ImageItem]]:
        """(the prompt with each `<|image_pad|>` expanded to its image's tokens, the ImageItems)."""
        pad = self.vision.image_token_id
        markers = ids.count(pad)
        if markers != len(images):
            raise ValueError(f"prompt: {markers} image placeholders (<|image_pad|>, token {pad}) for {len(images)} "
                             "images; give one placeholder per image")
        prepared = [self.prepare(as_image(image, f"image[{i}]"), f"image[{i}]") for i, image in enumerate(images)]
        out: list[int] = []
        items: list[ImageItem] = []
        for t in ids:
            if t != pad:
                out.append(t)
                continue
            pixels, grid = prepared[len(items)]
            items.append(ImageItem(pixel_hash(pixels), len(out), grid[0] * grid[1], pixels, grid))
            out += [pad] * (grid[0] * grid[1])
        return out, items

    def prepare(self, image, field: str):
        """(float32 [3, height, width] pixels, (rows, columns) of merged patches) of a PIL image."""
        v = self.vision
        height, width = smart_resize(image.size[1], image.size[0], v.factor, self.min_pixels, self.max_pixels, field)
        tokens = (height // v.factor) * (width // v.factor)
        if tokens > self.encoder_tokens:
            raise ValueError(f"{field}: the image takes {tokens} tokens at {width}x{height}, more than a step may "
                             f"encode ({self.encoder_tokens}: max_num_encoder_input_tokens / max_num_batched_tokens)")
        return preprocess(image, self.processing, (height, width)), (height // v.factor, width // v.factor)


def _count(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"preprocessor_config.json: {key} is {value!r}; it must be a positive number of pixels")
    return value
