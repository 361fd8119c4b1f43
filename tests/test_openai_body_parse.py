"""openai_server.request_body.parse_body, which runs on the thread pool for large bodies (issue 46, cause 4):
a lone surrogate is still refused naming where it is, whether it came as a high or low \\u escape
or as raw CESU-8 bytes, though a body with none is no longer walked value by value."""
from __future__ import annotations

import pytest

from openai_server.request_body import parse_body
from openai_server.translate import APIError


@pytest.mark.parametrize("raw, where", [
    (b'{"model": "llm", "prompt": "a\\ud800"}', "prompt"),
    (b'{"model": "llm", "prompt": ["ok", "\\uDFFF"]}', "prompt[1]"),
    (b'{"model": "llm", "messages": [{"role": "user", "content": "\xed\xb0\x80"}]}', "messages[0].content"),
])
def test_a_lone_surrogate_is_refused_naming_where(raw, where):
    with pytest.raises(APIError) as err:
        parse_body(raw)
    assert err.value.status == 400 and err.value.message.startswith(where), err.value.message


def test_bodies_without_one_parse_as_json_does():
    raw = b'{"model": "llm", "prompt": "caf\\u00e9 \\ud83d\\ude00", "n": 2}'
    assert parse_body(raw) == {"model": "llm", "prompt": "caf\u00e9 \U0001F600", "n": 2}
    with pytest.raises(APIError, match="must be a JSON object"):
        parse_body(b"[1]")
