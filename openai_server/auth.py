"""API keys on the OpenAI port (vLLM's `--api-key`, docs/security.md).

With keys set, every `/v1` route and `/tokenize`, `/detokenize` want `Authorization: Bearer KEY`,
one of the keys; anything else is a 401 in OpenAI's error shape (the SDK raises
`openai.AuthenticationError`). `/health` and `/metrics` stay open for probes and scrapers unless
`--api-key-all-routes` asks for the key there too. Keys come from `--api-key KEY ...` (vLLM takes
several), else `INFLIGHT_API_KEY` (one key, or several separated by commas), else vLLM's
`VLLM_API_KEY` (one key).

The check is a pure ASGI middleware (a streamed answer passes through untouched). Each key is
compared as its SHA-256 digest with `hmac.compare_digest`, against every key whatever matched, so
that neither a key's length nor which key matched shows in the time an answer takes.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

ENV_KEYS = "INFLIGHT_API_KEY"
VLLM_ENV_KEY = "VLLM_API_KEY"
OPEN_PATHS = ("/health", "/metrics")  # open unless all_routes
GUARDED_PREFIX = "/v1"
GUARDED_PATHS = ("/tokenize", "/detokenize")
# RFC 6750's b64token: what a Bearer credential may hold (no space, no comma)
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=")


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).digest()


def check_key(key: str, where: str) -> str:
    """A key as given, or ValueError naming `where` when no client could send it as a Bearer token."""
    if not key:
        raise ValueError(f"{where}: an API key must not be empty")
    odd = sorted({c for c in key if c not in _TOKEN_CHARS})
    if odd:
        raise ValueError(f"{where}: an API key is sent as 'Authorization: Bearer KEY' and may hold only letters, "
                         f"digits and -._~+/= (this one holds {''.join(odd)!r})")
    return key


def resolve_keys(flag: Optional[Sequence[str]], env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The keys the server wants: the flag's, else INFLIGHT_API_KEY's (comma-separated), else
    VLLM_API_KEY; [] when none is set (no key wanted)."""
    env = os.environ if env is None else env
    if flag:
        return [check_key(k, "--api-key") for k in flag]
    if env.get(ENV_KEYS):
        return [check_key(k.strip(), ENV_KEYS) for k in env[ENV_KEYS].split(",")]
    if env.get(VLLM_ENV_KEY):
        return [check_key(env[VLLM_ENV_KEY], VLLM_ENV_KEY)]
    return []


def unauthorized_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


class APIKeyMiddleware:
    """Answers 401 to a guarded path without one of `keys` as its Bearer token."""

    def __init__(self, app, keys: Iterable[str], all_routes: bool = False):
        self.app = app
        self.digests = [_digest(k) for k in keys]
        self.all_routes = all_routes

    def guarded(self, path: str) -> bool:
        if self.all_routes:
            return True
        if path in OPEN_PATHS:
            return False
        return path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/") or path in GUARDED_PATHS

    def authorized(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        got = _digest(token.strip())
        matched = False
        for digest in self.digests:  # every key, whichever matches
            matched |= hmac.compare_digest(got, digest)
        return matched and bool(token.strip())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.digests or not self.guarded(scope["path"]) \
                or self.authorized(scope.get("headers") or ()):
            await self.app(scope, receive, send)
            return
        has = any(k.lower() == b"authorization" for k, _ in scope.get("headers") or ())
        message = ("Incorrect API key provided" if has else
                   "You didn't provide an API key: send it as 'Authorization: Bearer KEY'")
        body = json.dumps(unauthorized_body(message)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="inflight"')]})
        await send({"type": "http.response.body", "body": body})


__all__ = ["APIKeyMiddleware", "resolve_keys", "check_key", "ENV_KEYS", "VLLM_ENV_KEY"]
