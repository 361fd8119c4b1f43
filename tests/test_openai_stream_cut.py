"""The OpenAI server's Triton stream cut by gRPC (UNAVAILABLE, "Stream removed (Socket closed)": the model's
process died, or the connection dropped) is the server's 503 with code triton_unavailable, as Triton
unreachable is (docs/reliability.md), not a 500 naming the gRPC exception: clients retry a 503, and the
OpenAI SDK does by default."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc.aio import AioRpcError, Metadata

from openai_server.translate import APIError
from openai_server.triton_backend import TritonBackend


class CutStream:
    """A client whose every stream gRPC cuts at its first read."""

    def __init__(self, code: grpc.StatusCode):
        self.code = code
        self.cancelled = False

    def stream_infer(self, requests):
        code = self.code
        owner = self

        class Responses:
            def __aiter__(self):
                return self

            async def __anext__(self):
                raise AioRpcError(code, Metadata(), Metadata(), details="Stream removed (Socket closed)")

            def cancel(self):
                owner.cancelled = True

        return Responses()


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL])
def test_a_stream_grpc_cuts_is_a_503_that_names_the_cut(code):
    backend = TritonBackend("localhost:1", "llm")
    backend._client = client = CutStream(code)
    backend._inputs, backend._outputs = frozenset({"text_input"}), ("text_output",)

    async def ask():
        async for _ in backend.generate({"text_input": (np.array([b"hi"], dtype=object), "BYTES")}):
            pass

    with pytest.raises(APIError) as caught:
        asyncio.run(ask())
    assert caught.value.status == 503 and caught.value.code == "triton_unavailable"
    assert "Stream removed (Socket closed)" in str(caught.value) and "localhost:1" in str(caught.value)
    assert client.cancelled  # the request is cancelled on the server, as on any early end
