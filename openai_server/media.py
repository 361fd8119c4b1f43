"""Images in chat messages (docs/vision.md): OpenAI's `image_url` content parts, fetched under the
operator's rules, and their place in the prompt.

`data:` URLs (PNG, JPEG, WebP, base64) are always taken. `file:` URLs only under
`--allowed-local-media-path` (vLLM's flag; the resolved path must stay inside it), http(s) URLs only
from a host of `--allowed-media-domains` (vLLM's flag), without redirects, within
`--media-fetch-timeout` seconds and the image byte limit. Everything else is refused with a 400 that
names the part. Each image part becomes the model's begin-of-image marker in the text the chat
template renders (Gemma 3's template writes the same `<start_of_image>` for an image item); the
engine expands the marker into the image's tokens and decodes the bytes, which travel to Triton as
the `image` input (base64, the vLLM backend's).
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from backend.core.defaults import MAX_IMAGE_BYTES
from backend.core.images import data_url_bytes
from openai_server.translate import bad

DEFAULT_FETCH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class MediaPolicy:
    """Where image URLs may point (the operator's flags)."""
    allowed_local_media_path: Optional[str] = None
    allowed_media_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = MAX_IMAGE_BYTES

    def load(self, url: str, field: str) -> bytes:
        """The image file's bytes behind `url`, or a 400 naming `field`."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            try:
                return data_url_bytes(url, field)
            except ValueError as exc:
                raise bad(field, str(exc)) from None
        if scheme == "file":
            return self._file(url, field)
        if scheme in ("http", "https"):
            return self._fetch(url, field)
        raise bad(field, f"{field}: unsupported URL scheme {scheme or url[:20]!r}; send a data:image/...;base64 URL")

    def _file(self, url: str, field: str) -> bytes:
        if not self.allowed_local_media_path:
            raise bad(field, f"{field}: file URLs are refused (the server was started without "
                             "--allowed-local-media-path)")
        root = os.path.realpath(self.allowed_local_media_path)
        path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        if os.path.commonpath([root, path]) != root:
            raise bad(field, f"{field}: {url} is outside --allowed-local-media-path")
        if not os.path.isfile(path):
            raise bad(field, f"{field}: no such file under --allowed-local-media-path")
        if os.path.getsize(path) > self.max_bytes:
            raise bad(field, f"{field}: the file is over {self.max_bytes} bytes")
        return Path(path).read_bytes()

    def _fetch(self, url: str, field: str) -> bytes:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if not host or host not in self.allowed_media_domains:
            raise bad(field, f"{field}: http(s) image URLs are refused unless their host is in "
                             f"--allowed-media-domains (host {host!r})")
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(url, timeout=self.fetch_timeout_s) as response:
                data = response.read(self.max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise bad(field, f"{field}: fetching the image failed ({exc})") from None
        if len(data) > self.max_bytes:
            raise bad(field, f"{field}: the image is over {self.max_bytes} bytes")
        return data


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off the allowed domains: refused."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.URLError(f"redirect to {newurl} refused")


class ImageParts:
    """The served model's begin-of-image marker (None: a text-only model) and the operator's policy."""

    def __init__(self, model_path: Optional[str], tokenizer, policy: Optional[MediaPolicy] = None):
        self.policy = policy or MediaPolicy()
        self.marker = _marker(model_path, tokenizer)

    def extract(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        """The body with each image part replaced by a text part holding the marker, and the images'
        bytes in order."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return body, []
        images: list[bytes] = []
        out = []
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list) or not any(_is_image(p) for p in content):
                out.append(message)
                continue
            parts = []
            for j, part in enumerate(content):
                if not _is_image(part):
                    parts.append(part)
                    continue
                field = f"messages[{i}].content[{j}].image_url"
                if self.marker is None:
                    raise bad(field, f"{field}: the served model takes no images (a text-only checkpoint)")
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                if not isinstance(url, str) or not url:
                    raise bad(field, f"{field}: give the image as {{\"url\": \"data:image/png;base64,...\"}}")
                images.append(self.policy.load(url, field))
                parts.append({"type": "text", "text": self.marker})
            out.append({**message, "content": parts})
        return ({**body, "messages": out}, images) if images else (body, [])


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "input_image", "image")


def _marker(model_path: Optional[str], tokenizer) -> Optional[str]:
    """Gemma 3's begin-of-image token as text, from config.json and the tokenizer."""
    if not model_path or tokenizer is None:
        return None
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not cfg.get("vision_config"):
        return None
    if "vision_start_token_id" in cfg:  # Qwen2.5-VL: as its chat template writes an image item
        names = [tokenizer.id_to_token(cfg.get(k)) if isinstance(cfg.get(k), int) else None
                 for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id")]
        return "".join(names) if all(names) else None
    boi = cfg.get("boi_token_index", cfg.get("boi_token_id", 255_999))
    return tokenizer.id_to_token(boi) if isinstance(boi, int) else None
