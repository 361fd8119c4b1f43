"""What the gRPC and HTTP clients share: the request options, the tensors they become, and what
comes back (one `Chunk` per response; a `Result` adds them up, with client-side timings).

Tensor names and types are the `llm` model's contract (DESIGN.md, templates/llm/config.pbtxt).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence, Union

import numpy as np

Prompt = Union[str, Sequence[int]]
MODEL_NAME = "llm"


class GenerationError(RuntimeError):
    """The server answered the request with an error (a bad request, a full queue, ...)."""


@dataclass
class Options:
    """Per-request options; None leaves the server's default (max_tokens 16, temperature 1.0, ...)."""
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop_words: Optional[Sequence[str]] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    exclude_input_in_output: Optional[bool] = None

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "Options":
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**kwargs)


# name -> (numpy dtype, Triton datatype)
TENSOR_TYPES = {
    "text_input": (np.object_, "BYTES"),
    "input_ids": (np.int32, "INT32"),
    "max_tokens": (np.int32, "INT32"),
    "stream": (np.bool_, "BOOL"),
    "temperature": (np.float32, "FP32"),
    "top_k": (np.int32, "INT32"),
    "top_p": (np.float32, "FP32"),
    "seed": (np.int64, "INT64"),
    "stop_words": (np.object_, "BYTES"),
    "ignore_eos": (np.bool_, "BOOL"),
    "min_tokens": (np.int32, "INT32"),
    "exclude_input_in_output": (np.bool_, "BOOL"),
    "stop": (np.bool_, "BOOL"),
}
OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens")


def request_tensors(prompt: Optional[Prompt], options: Options, stream: bool,
                    stop: bool = False) -> dict[str, tuple[np.ndarray, str]]:
    """The input tensors of one request: name -> (array, Triton datatype)."""
    values: dict[str, Any] = {}
    if stop:
        values["stop"] = True
    elif isinstance(prompt, str):
        values["text_input"] = prompt
    elif prompt is not None:
        values["input_ids"] = list(prompt)
    if not stop:
        values["stream"] = stream
        for f in fields(options):
            value = getattr(options, f.name)
            if value is not None:
                values[f.name] = value
    out = {}
    for name, value in values.items():
        dtype, triton_type = TENSOR_TYPES[name]
        if name in ("input_ids", "stop_words"):
            items = [v.encode("utf-8") if isinstance(v, str) else v for v in value]
            array = np.array(items, dtype=dtype).reshape([-1])
        elif dtype is np.object_:
            array = np.array([value.encode("utf-8")], dtype=dtype)
        else:
            array = np.array([value], dtype=dtype)
        out[name] = (array, triton_type)
    return out


def request_json(prompt: Optional[Prompt], options: Options, stream: bool,
                 request_id: Optional[str] = None, stop: bool = False) -> dict[str, Any]:
    """The JSON body of Triton's HTTP generate / generate_stream for one request."""
    body: dict[str, Any] = {}
    if request_id:
        body["id"] = request_id
    if stop:
        body["stop"] = True
        return body
    if isinstance(prompt, str):
        body["text_input"] = prompt
    elif prompt is not None:
        body["input_ids"] = [int(t) for t in prompt]
    body["stream"] = stream
    for f in fields(options):
        value = getattr(options, f.name)
        if value is not None:
            body[f.name] = list(value) if f.name == "stop_words" else value
    return body


@dataclass
class Chunk:
    """One response. Streaming: the new text and token ids of one engine step. Otherwise: all of
    them (with the prompt in front unless exclude_input_in_output)."""
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # None until the last response: stop | length | abort
    num_input_tokens: int
    num_output_tokens: int
    time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_arrays(cls, get) -> "Chunk":
        """`get(name)` returns the numpy array of an output, or None."""
        text = get("text_output")
        ids = get("output_ids")
        reason = get("finish_reason")
        n_in, n_out = get("num_input_tokens"), get("num_output_tokens")
        return cls(text="".join(_str(v) for v in text.reshape(-1)) if text is not None else "",
                   token_ids=[int(t) for t in ids.reshape(-1)] if ids is not None else [],
                   finish_reason=(_str(reason.reshape(-1)[0]) or None) if reason is not None and reason.size else None,
                   num_input_tokens=int(n_in.reshape(-1)[0]) if n_in is not None else 0,
                   num_output_tokens=int(n_out.reshape(-1)[0]) if n_out is not None else 0)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Chunk":
        """One HTTP generate answer or generate_stream event. Triton writes a one-element output
        as a scalar, so `output_ids` may be a bare number."""
        if "error" in data:
            raise GenerationError(data["error"])
        ids = data.get("output_ids", [])
        text = data.get("text_output", "")
        return cls(text="".join(text) if isinstance(text, list) else str(text),
                   token_ids=[int(t) for t in (ids if isinstance(ids, list) else [ids])],
                   finish_reason=_first(data.get("finish_reason")) or None,
                   num_input_tokens=int(_first(data.get("num_input_tokens")) or 0),
                   num_output_tokens=int(_first(data.get("num_output_tokens")) or 0))


def _str(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, (bytes, np.bytes_)) else str(value)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


@dataclass
class Result:
    """A whole request as the client saw it. `token_ids` and `text` are everything received."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_responses: int = 0
    start: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None
    end: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.num_responses += 1
        self.num_input_tokens = chunk.num_input_tokens or self.num_input_tokens
        self.num_output_tokens = chunk.num_output_tokens or self.num_output_tokens
        if chunk.token_ids or chunk.text:
            if self.first_token_time is None:
                self.first_token_time = chunk.time
            self.chunk_times.append(chunk.time)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.end = chunk.time

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.start

    @property
    def latency(self) -> Optional[float]:
        return None if self.end is None else self.end - self.start

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
