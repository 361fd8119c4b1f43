"""HTTP client for the `llm` model: Triton's `generate` and `generate_stream` endpoints, sync and asyncio.

    from client.http_client import HttpClient
    c = HttpClient("localhost:8000")
    print(c.generate("Hello", max_tokens=8, exclude_input_in_output=True).text)   # one response
    for chunk in c.stream("Hello", max_tokens=8):                                 # server-sent events
        print(chunk.text, end="", flush=True)
    c.stop("my-id")   # cancels the running request whose request id is "my-id"

Triton's HTTP `infer` endpoint refuses decoupled models ("HTTP end point doesn't support models
with decoupled transaction policy"), so these two endpoints are the HTTP way in. tritonclient's
HTTP client has no call for them, so this is plain HTTP: urllib for sync, aiohttp (which
tritonclient[http] brings) for asyncio. HTTP has no way to cancel a request other than `stop`.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, AsyncIterator, Iterator, Optional

from client.protocol import MODEL_NAME, Chunk, GenerationError, Options, Prompt, Result, request_json

DEFAULT_URL = "localhost:8000"


def _base(url: str) -> str:
    return url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"


def _error(status: int, raw: bytes) -> GenerationError:
    try:
        message = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", errors="replace")
    return GenerationError(f"HTTP {status}: {message}")


def _events(lines) -> Iterator[dict[str, Any]]:
    """The `data:` payloads of a server-sent-event stream, as JSON objects."""
    for raw in lines:
        line = raw.decode("utf-8").strip() if isinstance(raw, bytes) else raw.strip()
        if line.startswith("data:"):
            yield json.loads(line[5:].strip())


class HttpClient:
    def __init__(self, url: str = DEFAULT_URL, model: str = MODEL_NAME, timeout: float = 600.0):
        self.base = _base(url)
        self.model = model
        self.timeout = timeout

    def _post(self, endpoint: str, body: dict[str, Any]):
        request = urllib.request.Request(f"{self.base}/v2/models/{self.model}/{endpoint}",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise _error(exc.code, exc.read()) from None

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/v2/models/{self.model}/ready", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def generate(self, prompt: Prompt, *, request_id: Optional[str] = None, **options) -> Result:
        """`generate`: one response with the whole answer."""
        body = request_json(prompt, Options.from_kwargs(options), False, request_id)
        result = Result()
        with self._post("generate", body) as response:
            result.add(Chunk.from_json(json.loads(response.read())))
        return result

    def stream(self, prompt: Prompt, *, request_id: Optional[str] = None, **options) -> Iterator[Chunk]:
        """`generate_stream`: one server-sent event per engine step."""
        body = request_json(prompt, Options.from_kwargs(options), True, request_id)
        with self._post("generate_stream", body) as response:
            for event in _events(response):
                chunk = Chunk.from_json(event)
                yield chunk
                if chunk.finished:
                    return

    def generate_stream(self, prompt: Prompt, *, request_id: Optional[str] = None, **options) -> Result:
        result = Result()
        for chunk in self.stream(prompt, request_id=request_id, **options):
            result.add(chunk)
        return result

    def stop(self, request_id: str) -> Chunk:
        """Cancel the running request with this id (a `stop` request); raises if none is running."""
        with self._post("generate", request_json(None, Options(), False, request_id, stop=True)) as r:
            return Chunk.from_json(json.loads(r.read()))


class AsyncHttpClient:
    """asyncio version over aiohttp; use as `async with AsyncHttpClient(url) as c:`."""

    def __init__(self, url: str = DEFAULT_URL, model: str = MODEL_NAME, timeout: float = 600.0):
        self.base = _base(url)
        self.model = model
        self.timeout = timeout
        self._session = None

    async def _sessioned(self):
        if self._session is None:
            import aiohttp
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def _post(self, endpoint: str, body: dict[str, Any]):
        session = await self._sessioned()
        response = await session.post(f"{self.base}/v2/models/{self.model}/{endpoint}", json=body)
        if response.status != 200:
            raw = await response.read()
            response.release()
            raise _error(response.status, raw)
        return response

    async def is_ready(self) -> bool:
        session = await self._sessioned()
        try:
            async with session.get(f"{self.base}/v2/models/{self.model}/ready") as r:
                return r.status == 200
        except Exception:
            return False

    async def generate(self, prompt: Prompt, *, request_id: Optional[str] = None, **options) -> Result:
        body = request_json(prompt, Options.from_kwargs(options), False, request_id)
        result = Result()
        response = await self._post("generate", body)
        async with response:
            result.add(Chunk.from_json(json.loads(await response.read())))
        return result

    async def stream(self, prompt: Prompt, *, request_id: Optional[str] = None,
                     **options) -> AsyncIterator[Chunk]:
        body = request_json(prompt, Options.from_kwargs(options), True, request_id)
        response = await self._post("generate_stream", body)
        async with response:
            async for raw in response.content:
                for event in _events([raw]):
                    chunk = Chunk.from_json(event)
                    yield chunk
                    if chunk.finished:
                        return

    async def generate_stream(self, prompt: Prompt, *, request_id: Optional[str] = None,
                              **options) -> Result:
        result = Result()
        async for chunk in self.stream(prompt, request_id=request_id, **options):
            result.add(chunk)
        return result

    async def stop(self, request_id: str) -> Chunk:
        response = await self._post("generate", request_json(None, Options(), False, request_id, stop=True))
        async with response:
            return Chunk.from_json(json.loads(await response.read()))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "AsyncHttpClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
