"""A request's body: read with a size limit (413 past it, before buffering it) and parsed into a
JSON object (400 for anything else, or a lone surrogate the model could not take). A large body is
parsed on the app's thread pool (app.py: OFF_LOOP_BYTES), so `parse_body` lets go of the GIL often."""
from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from backend.core.input_guard import lone_surrogate
from openai_server.translate import APIError, bad

MAX_BODY_BYTES = 8 << 20
# a lone surrogate can only come from a \ud800-\udfff escape or its raw CESU-8 bytes (json.loads
# decodes bytes with surrogatepass): a body with neither needs no walk through its values
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, read chunk by chunk and refused (413) as soon as it passes `limit`: a declared
    Content-Length past it is refused before anything is read, and a chunked body is never
    buffered beyond it (reading it whole first would hold any amount a client sends)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"Content-Length is not a number: {declared[:40]!r}")
        if int(declared) > limit:
            raise APIError(413, f"the request body is {int(declared)} bytes; the limit is {limit}")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes (the limit)")
        parts.append(chunk)
    return b"".join(parts)


def _same(obj: dict) -> dict:
    """json.loads' object_hook: a Python call per object, where the thread can let go of the GIL (a
    6 MiB body parsed in one C call held the event loop 0.3 s; with it, 0.07 s at most)."""
    return obj


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body -> its JSON object, refused (400) when it is not one or holds a lone surrogate."""
    try:
        body = json.loads(raw, object_hook=_same)
    except RecursionError:  # json's C scanner recurses once per nesting level
        raise APIError(400, "the request body is nested too deeply to be a request") from None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if not _MAYBE_SURROGATE.search(raw):
        return body
    for key, value in body.items():  # "\ud800" is valid JSON, and no text the model can take
        where = lone_surrogate(value, key) or (key if lone_surrogate(key, key) else None)
        if where is not None:
            raise bad(key, f"{where} is not valid Unicode text: it holds a lone surrogate (an unpaired "
                           "\\ud800-\\udfff escape), which UTF-8 cannot encode")
    return body
