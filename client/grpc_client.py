"""gRPC client for the `llm` model over Triton's bidirectional stream (tritonclient), sync and asyncio.

    from client.grpc_client import GrpcClient
    with GrpcClient("localhost:8001") as c:
        for chunk in c.stream("Once upon a time", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
        result = c.generate("Hello", max_tokens=8)          # one response at the end

    async with AsyncGrpcClient("localhost:8001") as c:
        async for chunk in c.stream("Hello"): ...

Decoupled models answer over the stream only (gRPC `ModelInfer` is for one-response models).
Leaving a `stream(...)` loop early cancels the request on the server (its KV blocks are freed
within a step). A `GrpcClient` runs one request at a time; make one per concurrent caller, or use
`AsyncGrpcClient`, whose requests each get their own stream.
"""
from __future__ import annotations

import queue
import uuid
from typing import AsyncIterator, Iterator, Optional

import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from client.protocol import (MODEL_NAME, OUTPUTS, Chunk, GenerationError, Options, Prompt, Result,
                             request_tensors)

DEFAULT_URL = "localhost:8001"


def _inputs(module, prompt: Optional[Prompt], options: Options, stream: bool, stop: bool = False):
    inputs = []
    for name, (array, triton_type) in request_tensors(prompt, options, stream, stop).items():
        tensor = module.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _outputs(module):
    return [module.InferRequestedOutput(name) for name in OUTPUTS]


def _error_text(error) -> str:
    message = getattr(error, "message", None)
    return message() if callable(message) else str(error)


def _read(result, error) -> tuple[Optional[Chunk], bool]:
    """One message of the stream -> (its chunk, or None for an empty final response; whether the
    request is finished). An error response ends the request: it is raised."""
    if error is not None:
        raise GenerationError(_error_text(error))
    response = result.get_response()
    chunk = Chunk.from_arrays(result.as_numpy) if len(response.outputs) else None
    final = "triton_final_response" in response.parameters and \
        response.parameters["triton_final_response"].bool_param
    return chunk, final or (chunk is not None and chunk.finished)


class GrpcClient:
    """Synchronous client; one request at a time per instance."""

    def __init__(self, url: str = DEFAULT_URL, model: str = MODEL_NAME, timeout: float = 600.0,
                 verbose: bool = False):
        self.url = url
        self.model = model
        self.timeout = timeout  # the longest wait for one response, in seconds
        self._client = grpcclient.InferenceServerClient(url, verbose=verbose)

    def is_ready(self) -> bool:
        try:
            return self._client.is_model_ready(self.model)
        except Exception:
            return False

    def stream(self, prompt: Prompt, *, stream: bool = True, request_id: Optional[str] = None,
               **options) -> Iterator[Chunk]:
        """Send one request and yield its responses as they arrive (one per step when streaming)."""
        opts = Options.from_kwargs(options)
        inputs = _inputs(grpcclient, prompt, opts, stream)
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        done = False
        try:
            try:
                self._client.async_stream_infer(self.model, inputs, outputs=_outputs(grpcclient),
                                                request_id=request_id or uuid.uuid4().hex,
                                                enable_empty_final_response=True,
                                                parameters=opts.parameters() or None)
            except InferenceServerException as exc:
                # The stream broke before the request went out; its callback holds the reason.
                try:
                    _read(*responses.get(timeout=1.0))
                except queue.Empty:
                    pass
                raise GenerationError(str(exc)) from None
            while not done:
                try:
                    message = responses.get(timeout=self.timeout)
                except queue.Empty:
                    raise TimeoutError(f"no response from {self.url} in {self.timeout:.0f}s") from None
                chunk, done = _read(*message)
                if chunk is not None:
                    yield chunk
        finally:
            # Early exit (break, an exception, a timeout): cancel the request on the server.
            self._client.stop_stream(cancel_requests=not done)

    def generate(self, prompt: Prompt, *, stream: bool = False, request_id: Optional[str] = None,
                 **options) -> Result:
        """The whole answer. stream=False asks for one response; True adds the per-step ones up."""
        result = Result()
        for chunk in self.stream(prompt, stream=stream, request_id=request_id, **options):
            result.add(chunk)
        return result

    def stop(self, request_id: str) -> Chunk:
        """Cancel a running request by its id (the `stop` input); raises if none is running."""
        inputs = _inputs(grpcclient, None, Options(), False, stop=True)
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            self._client.async_stream_infer(self.model, inputs, request_id=request_id)
            result, error = responses.get(timeout=self.timeout)
        finally:
            self._client.stop_stream()
        if error is not None:
            raise GenerationError(_error_text(error))
        return Chunk.from_arrays(result.as_numpy)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "GrpcClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGrpcClient:
    """asyncio client (tritonclient.grpc.aio); any number of concurrent requests, a stream each."""

    def __init__(self, url: str = DEFAULT_URL, model: str = MODEL_NAME, verbose: bool = False):
        self.url = url
        self.model = model
        self._client = grpcaio.InferenceServerClient(url, verbose=verbose)

    async def is_ready(self) -> bool:
        try:
            return await self._client.is_model_ready(self.model)
        except Exception:
            return False

    async def stream(self, prompt: Prompt, *, stream: bool = True, request_id: Optional[str] = None,
                     **options) -> AsyncIterator[Chunk]:
        import asyncio

        opts = Options.from_kwargs(options)
        inputs = _inputs(grpcaio, prompt, opts, stream)
        finished = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "outputs": _outputs(grpcaio),
                   "request_id": request_id or uuid.uuid4().hex, "parameters": opts.parameters() or None}
            await finished.wait()  # keep our side open until the answer is complete

        responses = self._client.stream_infer(requests())
        done = False
        try:
            async for message in responses:
                chunk, done = _read(*message)
                if chunk is not None:
                    yield chunk
                if done:
                    break
        finally:
            finished.set()
            if not done:
                responses.cancel()  # early exit: the server cancels the request

    async def generate(self, prompt: Prompt, *, stream: bool = False,
                       request_id: Optional[str] = None, **options) -> Result:
        result = Result()
        async for chunk in self.stream(prompt, stream=stream, request_id=request_id, **options):
            result.add(chunk)
        return result

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> "AsyncGrpcClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
