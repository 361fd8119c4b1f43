"""Images decoded and preprocessed for a vision-language model, off the engine thread (the doors'
threads call this), with PIL and numpy only: no torch (docs/vision.md).

`decode_image` takes the bytes a client sent (PNG, JPEG or WebP) and refuses, in a ValueError naming
the field, what is not one of them, a file cut short or corrupt, an image with a zero side, and a
decompression bomb: more than `max_pixels` pixels (PIL's own limit, `Image.MAX_IMAGE_PIXELS`, is set
to the same number, so PIL refuses it too before decoding a byte of pixels).

`preprocess` is Gemma 3's image processor with pan-and-scan off (transformers'
Gemma3ImageProcessorPil): RGB (transparency composited onto white), resized to the vision tower's square size with PIL's bilinear
filter, rescaled by 1/255 and normalized with the processor's mean and std, channels first. Given a
(height, width) and the bicubic filter it is Qwen2-VL's processor (Qwen2VLImageProcessorPil) before
its patches are cut (backend/engine/qwen2_5_vl_images.py).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

import numpy as np

from backend.core.defaults import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS

FORMATS = ("PNG", "JPEG", "WEBP")
MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}


def _pil():
    from PIL import Image
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS  # set explicitly: PIL refuses past twice this (a bomb)
    return Image


@dataclass(frozen=True)
class ImageProcessing:
    """How a model's processor prepares an image (Gemma 3's: preprocessor_config.json, else its
    defaults with the vision tower's size)."""
    size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: str = "BILINEAR"  # PIL's filter (Qwen2-VL: BICUBIC)


def decode_image(data: bytes, field: str, max_pixels: int = MAX_IMAGE_PIXELS, max_bytes: int = MAX_IMAGE_BYTES):
    """A PIL image, fully decoded, or a ValueError naming `field`."""
    if not data:
        raise ValueError(f"{field}: the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ValueError(f"{field}: the image is {len(data)} bytes; the limit is {max_bytes} bytes")
    image_mod = _pil()
    try:
        image = image_mod.open(io.BytesIO(data), formats=list(FORMATS))
    except image_mod.DecompressionBombError:
        raise ValueError(f"{field}: the image has too many pixels (a decompression bomb); the limit is "
                         f"{max_pixels} pixels") from None
    except Exception as exc:  # PIL raises UnidentifiedImageError, SyntaxError, struct errors, ...
        raise ValueError(f"{field}: not a PNG, JPEG or WebP image ({type(exc).__name__}: {exc})") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"{field}: the image is {width}x{height}; both sides must be at least 1 pixel")
    if width * height > max_pixels:
        raise ValueError(f"{field}: the image is {width}x{height} = {width * height} pixels; the limit is "
                         f"{max_pixels} pixels (a decompression bomb is refused before decoding)")
    try:
        image.load()
    except Exception as exc:  # truncated or corrupt pixel data
        raise ValueError(f"{field}: the {image.format} image is corrupt or truncated ({exc})") from None
    return image


def base64_bytes(text, field: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """A base64 string (the vLLM backend's `image` input; a data URL's payload) -> its bytes, the
    size capped before decoding."""
    if len(text) > (max_bytes + 2) // 3 * 4 + 4:
        raise ValueError(f"{field}: the image is over {max_bytes} bytes (base64 of {len(text)} characters)")
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError(f"{field}: not valid base64") from None


def decode_base64_image(text: str, field: str, **limits):
    """A base64 string -> a PIL image."""
    return decode_image(base64_bytes(text, field), field, **limits)


def decode_data_url(url: str, field: str, **limits):
    """A `data:image/<png|jpeg|webp>;base64,...` URL -> a PIL image."""
    return decode_image(data_url_bytes(url, field), field, **limits)


def data_url_bytes(url: str, field: str) -> bytes:
    """A `data:image/<png|jpeg|webp>;base64,...` URL -> the image file's bytes."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise ValueError(f"{field}: a data URL must read data:image/<png|jpeg|webp>;base64,<data>")
    mime = head[5:-7].lower()
    if mime not in MIME_TYPES:
        raise ValueError(f"{field}: unsupported image type {mime!r}; supported: image/png, image/jpeg, image/webp")
    return base64_bytes(payload, field)


def preprocess(image, processing: ImageProcessing, size: "tuple[int, int] | None" = None) -> np.ndarray:
    """float32 [3, size, size], as Gemma 3's processor (pan-and-scan off) makes it; [3, height,
    width] given `size` (height, width)."""
    image_mod = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:  # onto white, as transformers
        rgba = image.convert("RGBA")
        rgb = image_mod.alpha_composite(image_mod.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    else:
        rgb = image.convert("RGB")
    height, width = size or (processing.size, processing.size)
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), resample=getattr(image_mod.Resampling, processing.resample))
    pixels = np.asarray(rgb, dtype=np.float32) * np.float32(processing.rescale)
    mean = np.asarray(processing.mean, dtype=np.float32)
    std = np.asarray(processing.std, dtype=np.float32)
    return np.ascontiguousarray(((pixels - mean) / std).transpose(2, 0, 1))


def pixel_hash(pixels: np.ndarray) -> str:
    """The image's key: sha256 of its preprocessed pixels and their shape (hex)."""
    h = hashlib.sha256(repr(pixels.shape).encode())
    h.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return h.hexdigest()
