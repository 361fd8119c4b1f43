"""The OpenAI server's image URLs (openai_server/media.py, docs/vision.md) without a server: data
URLs always; file URLs only under --allowed-local-media-path (a path that resolves outside it is
refused); http(s) only from --allowed-media-domains, fetched from a real loopback HTTP server, with no
redirect followed and the size limit kept; the parts of a chat replaced by the model's marker, and
refused for a text-only model. Every refusal is a 400 naming the part."""
from __future__ import annotations

import base64
import json

import pytest

from loopback_http import Quiet, serving
from openai_server.media import ImageParts, MediaPolicy
from openai_server.translate import APIError

PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
FIELD = "messages[0].content[1].image_url"


def refused(policy, url, words):
    with pytest.raises(APIError) as info:
        policy.load(url, FIELD)
    assert info.value.status == 400 and words in str(info.value) and str(info.value).startswith(FIELD)


@pytest.fixture(scope="module")
def web():
    """A loopback HTTP server: /cat.png (the PNG), /big (past a 100-byte limit), /hop (a redirect)."""
    class Handler(Quiet):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/hop":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
                return
            self.send_body(PNG if self.path == "/cat.png" else b"x" * 1000)

    with serving(Handler) as (base, _):
        yield base


def test_data_urls_always_and_other_schemes_refused_by_default(tmp_path):
    policy = MediaPolicy()
    assert policy.load("data:image/png;base64," + base64.b64encode(PNG).decode(), FIELD) == PNG
    refused(policy, "data:image/gif;base64,R0lGODlh", "unsupported image type")
    refused(policy, f"file://{tmp_path}/x.png", "--allowed-local-media-path")
    refused(policy, "https://example.com/cat.png", "--allowed-media-domains")
    refused(policy, "ftp://example.com/cat.png", "unsupported URL scheme")


def test_file_urls_only_inside_the_allowed_folder(tmp_path):
    inside = tmp_path / "images"
    inside.mkdir()
    (inside / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    policy = MediaPolicy(allowed_local_media_path=str(inside))
    assert policy.load(f"file://{inside}/cat.png", FIELD) == PNG
    refused(policy, f"file://{inside}/../secret.png", "outside --allowed-local-media-path")
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    refused(policy, f"file://{inside}/link.png", "outside --allowed-local-media-path")
    refused(policy, f"file://{inside}/missing.png", "no such file")


def test_http_only_from_allowed_hosts_without_redirects_within_the_limit(web):
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_bytes=100, fetch_timeout_s=5)
    assert policy.load(f"{web}/cat.png", FIELD) == PNG
    refused(policy, f"{web}/hop", "redirect")
    refused(policy, f"{web}/big", "over 100 bytes")
    refused(MediaPolicy(allowed_media_domains=("images.example.com",)), f"{web}/cat.png", "--allowed-media-domains")


class _Tokenizer:
    def id_to_token(self, token_id):
        return {2000: "<start_of_image>"}.get(token_id)


def test_a_chat_s_image_parts_become_the_marker_and_a_text_only_model_refuses_them(tmp_path):
    vision = tmp_path / "vision"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"vision_config": {"image_size": 48}, "boi_token_index": 2000}))
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    body = {"model": "llm", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    new, images = ImageParts(str(vision), _Tokenizer()).extract(body)
    assert images == [PNG]
    assert new["messages"][0]["content"] == [{"type": "text", "text": "Look:"},
                                             {"type": "text", "text": "<start_of_image>"}]
    assert body["messages"][0]["content"][1]["type"] == "image_url"  # the caller's body is left as sent
    text_only = tmp_path / "text"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(APIError, match="takes no images") as info:
        ImageParts(str(text_only), _Tokenizer()).extract(body)
    assert info.value.param == FIELD
