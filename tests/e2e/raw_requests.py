"""Requests built by hand, the way other clients build them (not through client/): the gRPC
stream of tritonclient as the vLLM backend's samples and CI tests use it, and Triton's HTTP
generate / generate_stream JSON. Each returns the responses as {output name: value}."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Mapping, Optional

import numpy as np
import tritonclient.grpc as grpcclient

WIRE = {np.dtype(np.bool_): "BOOL", np.dtype(np.int32): "INT32", np.dtype(np.uint64): "UINT64",
        np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.object_): "BYTES"}
HTTP_META = ("model_name", "model_version", "id")


def array(value: Any, dtype=None, trtllm: bool = False) -> np.ndarray:
    """A [1] tensor (the vLLM format) or a [1, 1] one (the TensorRT-LLM format)."""
    if isinstance(value, str):
        value, dtype = value.encode("utf-8"), np.object_
    a = np.array([value], dtype=dtype or (np.bool_ if isinstance(value, bool) else None))
    return a.reshape(1, 1) if trtllm else a


def grpc_stream(url: str, inputs: Mapping[str, np.ndarray], parameters: Optional[dict] = None,
                model: str = "llm", timeout: float = 60) -> list[dict[str, np.ndarray]]:
    """As the vLLM backend's CI and samples/client.py: start_stream, async_stream_infer (with
    request `parameters=`, no requested outputs), stop_stream (waits for every response)."""
    got: list = []
    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, value in inputs.items():
        t = grpcclient.InferInput(name, list(value.shape), WIRE[value.dtype])
        t.set_data_from_numpy(value)
        tensors.append(t)
    def callback(result, error):
        got.append((result, error))

    try:
        client.start_stream(callback=callback, stream_timeout=timeout)
        client.async_stream_infer(model, tensors, parameters=parameters)
        client.stop_stream()
    finally:
        client.close()
    out = []
    for result, error in got:
        if error is not None:
            raise RuntimeError(error.message() if hasattr(error, "message") else str(error))
        out.append({o.name: result.as_numpy(o.name) for o in result.get_response().outputs})
    return out


def http_generate(url: str, body: Mapping[str, Any], stream: bool, model: str = "llm",
                  timeout: float = 60) -> list[dict[str, Any]]:
    """Triton's HTTP generate (one JSON answer) or generate_stream (server-sent events)."""
    endpoint = "generate_stream" if stream else "generate"
    base = url if "://" in url else f"http://{url}"
    request = urllib.request.Request(f"{base}/v2/models/{model}/{endpoint}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            raw = r.read().decode()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(exc.read().decode()) from None
    events = ([json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]
              if stream else [json.loads(raw)])
    for event in events:
        if "error" in event:
            raise RuntimeError(event["error"])
    return [{k: v for k, v in e.items() if k not in HTTP_META} for e in events]
