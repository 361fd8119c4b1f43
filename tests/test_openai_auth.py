"""API keys on the OpenAI port (openai_server/auth.py), on the ASGI middleware alone: which paths
want the key, what a 401 says, where the keys come from. The SDK's view against the real stack is
tests/e2e/test_openai_responses_api.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from openai_server.auth import APIKeyMiddleware, resolve_keys


def call(mw: APIKeyMiddleware, path: str, authorization: str | None = None) -> tuple[int, dict]:
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message):
        sent.append(message)

    mw.app = app
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    asyncio.run(mw({"type": "http", "path": path, "headers": headers}, None, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


KEYS = ["first-key", "second.key"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/v1/responses", "/v1", "/tokenize",
                                  "/detokenize"])
def test_guarded_paths_want_one_of_the_keys(path):
    mw = APIKeyMiddleware(None, KEYS)
    status, body = call(mw, path)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert set(body["error"]) == {"message", "type", "param", "code"} and "provide" in body["error"]["message"]
    assert call(mw, path, "Bearer wrong")[0] == 401
    assert call(mw, path, "Bearer first-key-and-more")[0] == 401
    assert call(mw, path, "Basic first-key")[0] == 401
    assert call(mw, path, "Bearer ")[0] == 401
    assert call(mw, path, "Bearer first-key")[0] == 200
    assert call(mw, path, "bearer second.key")[0] == 200  # the scheme is case-insensitive (RFC 7235)


def test_health_and_metrics_are_open_unless_asked():
    open_ = APIKeyMiddleware(None, KEYS)
    assert call(open_, "/health")[0] == call(open_, "/metrics")[0] == 200
    assert call(open_, "/v1x")[0] == 200  # not a /v1 route: FastAPI's 404, not ours
    closed = APIKeyMiddleware(None, KEYS, all_routes=True)
    assert call(closed, "/health")[0] == call(closed, "/metrics")[0] == 401
    assert call(closed, "/metrics", "Bearer first-key")[0] == 200


def test_no_keys_no_check():
    assert call(APIKeyMiddleware(None, []), "/v1/models")[0] == 200


def test_keys_come_from_the_flag_then_inflight_then_vllm():
    env = {"INFLIGHT_API_KEY": "a,b", "VLLM_API_KEY": "v"}
    assert resolve_keys(["x", "y"], env) == ["x", "y"]
    assert resolve_keys(None, env) == ["a", "b"]
    assert resolve_keys(None, {"VLLM_API_KEY": "v"}) == ["v"]
    assert resolve_keys(None, {}) == []
    with pytest.raises(ValueError, match="--api-key"):
        resolve_keys(["has space"], {})
    with pytest.raises(ValueError, match="INFLIGHT_API_KEY"):
        resolve_keys(None, {"INFLIGHT_API_KEY": "a,,b"})
