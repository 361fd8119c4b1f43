"""What the gRPC and HTTP clients share: the request options, the tensors they become, and what
comes back (one `Chunk` per response; a `Result` adds them up, with client-side timings).

Tensor names and types are the `llm` model's contract (docs/design.md, templates/llm/config.pbtxt).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence, Union

import numpy as np

from templates import tensors as tensor_table

Prompt = Union[str, Sequence[int]]
MODEL_NAME = "llm"


class GenerationError(RuntimeError):
    """The server answered the request with an error (a bad request, a full queue, ...)."""


# The requests this library sends ask for the outputs `Result` shows (the model sends an output
# other than text_output and output_ids only when asked, as the vLLM backend does).
SHOWN = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


@dataclass
class Options:
    """Per-request options; None leaves the server's default (max_tokens: MAX_TOKENS of
    backend/core/defaults.py; temperature 1.0, ...).
    `n`, `logprobs` and `lora_name` travel as request parameters (they have no input tensor); asking for
    logprobs also asks for the logprobs and cumulative_logprob outputs."""
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop_words: Optional[Sequence[str]] = None
    bad_words: Optional[Sequence[str]] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    priority: Optional[int] = None
    exclude_input_in_output: Optional[bool] = None
    n: Optional[int] = None
    logprobs: Optional[int] = None
    queue_info: Optional[bool] = None  # where the request stands (return_queue_info): Chunk.queue
    lora_name: Optional[str] = None  # a LoRA adapter the server loaded (docs/lora.md)

    PARAMETERS = ("n", "logprobs", "lora_name")
    SWITCHES = ("queue_info",)  # they only add return_* inputs

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "Options":
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; allowed: {sorted(names)}")
        return cls(**kwargs)

    def returns(self) -> tuple[str, ...]:
        extra = ("return_logprobs", "return_cumulative_logprob") if self.logprobs is not None else ()
        return SHOWN + extra + (("return_queue_info",) if self.queue_info else ())

    def parameters(self) -> dict[str, Any]:
        """The request parameters: the sampling keys that have no input tensor."""
        return {name: getattr(self, name) for name in self.PARAMETERS if getattr(self, name) is not None}


_NUMPY = {"STRING": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT32": np.uint32, "INT64": np.int64,
          "UINT64": np.uint64, "FP32": np.float32, "FP64": np.float64}
# name -> (numpy dtype, Triton wire datatype), from the model's tensor table
TENSOR_TYPES = {t.name: (_NUMPY[t.data_type], "BYTES" if t.data_type == "STRING" else t.data_type)
                for t in tensor_table.INPUTS}
OUTPUTS = tuple(t.name for t in tensor_table.OUTPUTS)
_LISTS = {t.name for t in tensor_table.INPUTS if t.dims == (-1,)}
_INTEGER_TYPES = ("INT32", "UINT32", "INT64", "UINT64")


def checked_ints(name: str, values: Sequence[Any], triton_type: str) -> list[int]:
    """Integers that fit the input's type, or ValueError naming the value: numpy wraps an
    out-of-range Python int (4294967301 becomes 5 in an INT32), and Triton wraps a JSON number the
    same way, so past this point nobody could tell."""
    info = np.iinfo(_NUMPY[triton_type])
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name}: {v!r} is not an integer")
        if not info.min <= int(v) <= info.max:
            hint = " (token ids are in [0, vocabulary size))" if name == "input_ids" else ""
            raise ValueError(f"{name}: {int(v)} does not fit {triton_type} [{info.min}, {info.max}]{hint}")
        out.append(int(v))
    return out


def request_tensors(prompt: Optional[Prompt], options: Options, stream: bool,
                    stop: bool = False) -> dict[str, tuple[np.ndarray, str]]:
    """The input tensors of one request: name -> (array, Triton datatype)."""
    values: dict[str, Any] = {}
    if stop:
        values["stop"] = True
        values["return_finish_reason"] = True
    elif isinstance(prompt, str):
        values["text_input"] = prompt
    elif prompt is not None:
        values["input_ids"] = list(prompt)
    if not stop:
        values["stream"] = stream
        values.update((name, True) for name in options.returns())
        for f in fields(options):
            value = getattr(options, f.name)
            if value is not None and f.name not in Options.PARAMETERS + Options.SWITCHES:
                values[f.name] = value
    out = {}
    for name, value in values.items():
        dtype, triton_type = TENSOR_TYPES[name]
        if triton_type in _INTEGER_TYPES:  # never let numpy wrap a value that does not fit
            checked_ints(name, value if name in _LISTS else [value], triton_type)
        if name in _LISTS:
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
    """The JSON body of Triton's HTTP generate / generate_stream for one request. A field that is
    not an input becomes a request parameter (that is how `n` and `logprobs` travel)."""
    body: dict[str, Any] = {}
    if request_id:
        body["id"] = request_id
    if stop:
        body["stop"] = True
        body["return_finish_reason"] = True
        return body
    if isinstance(prompt, str):
        body["text_input"] = prompt
    elif prompt is not None:
        body["input_ids"] = checked_ints("input_ids", list(prompt), "INT32")
    body["stream"] = stream
    body.update((name, True) for name in options.returns())
    for f in fields(options):
        value = getattr(options, f.name)
        if value is not None and f.name not in Options.SWITCHES:
            body[f.name] = list(value) if f.name in _LISTS else value
            if TENSOR_TYPES.get(f.name, (None, ""))[1] in _INTEGER_TYPES:
                checked_ints(f.name, [value], TENSOR_TYPES[f.name][1])
    return body


@dataclass
class Chunk:
    """One response. Streaming: the new text and token ids of one engine step. Otherwise: all of
    them (with the prompt in front unless exclude_input_in_output). `text`, `token_ids`,
    `finish_reason`, `logprobs` are the first completion's; `texts` and `finish_reasons` have one
    entry per completion (n > 1). `num_output_tokens` counts this response's tokens."""
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]  # None until the last response: stop | length | abort
    num_input_tokens: int
    num_output_tokens: int
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[Optional[str]] = field(default_factory=list)
    logprobs: Optional[list[dict[str, Any]]] = None  # per token: {token id: {logprob, rank, decoded_token}}
    cumulative_logprob: Optional[float] = None
    queue: Optional[dict[str, Any]] = None  # the return_queue_info outputs, by name, when present
    time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(r is not None for r in (self.finish_reasons or [self.finish_reason]))

    @classmethod
    def build(cls, texts: list[str], ids: list[int], reasons: list[Any], n_in: Any, n_out: list[Any],
              logprobs: list[Any], cumulative: list[Any]) -> "Chunk":
        reasons_ = [None if _str(r) in ("", "None") else _str(r) for r in reasons]
        first_lp = _str(logprobs[0]) if logprobs else "null"
        return cls(text=texts[0] if texts else "", token_ids=[int(t) for t in ids],
                   finish_reason=reasons_[0] if reasons_ else None,
                   num_input_tokens=int(n_in) if n_in is not None else 0,
                   num_output_tokens=int(n_out[0]) if n_out else 0, texts=texts, finish_reasons=reasons_,
                   logprobs=json.loads(first_lp), cumulative_logprob=float(cumulative[0]) if cumulative else None)

    @classmethod
    def from_arrays(cls, get) -> "Chunk":
        """`get(name)` returns the numpy array of an output, or None."""
        def values(name):
            array = get(name)
            return [] if array is None else list(array.reshape(-1))
        n_in = values("num_input_tokens")
        chunk = cls.build([_str(v) for v in values("text_output")], values("output_ids"), values("finish_reason"),
                          n_in[0] if n_in else None, values("num_output_tokens"), values("logprobs"),
                          values("cumulative_logprob"))
        chunk.queue = _queue({name: values(name) for name in tensor_table.QUEUE_INFO_OUTPUTS})
        return chunk

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Chunk":
        """One HTTP generate answer or generate_stream event. Triton writes a one-element output
        as a scalar, so any output may be a bare value."""
        if "error" in data:
            raise GenerationError(data["error"])

        def values(name):
            value = data.get(name)
            return [] if value is None else value if isinstance(value, list) else [value]
        n_in = values("num_input_tokens")
        chunk = cls.build([str(v) for v in values("text_output")], values("output_ids"), values("finish_reason"),
                          n_in[0] if n_in else None, values("num_output_tokens"), values("logprobs"),
                          values("cumulative_logprob"))
        chunk.queue = _queue({name: values(name) for name in tensor_table.QUEUE_INFO_OUTPUTS})
        return chunk


def _queue(found: dict[str, list]) -> Optional[dict[str, Any]]:
    if not any(found.values()):
        return None
    return {k: (float(v[0]) if k in ("seconds_since_arrival", "expected_wait_seconds") else int(v[0]))
            for k, v in found.items() if v}


def _str(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, (bytes, np.bytes_)) else str(value)


@dataclass
class Result:
    """A whole request as the client saw it. `token_ids` and `text` are everything received;
    `texts` per completion (n > 1)."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0  # the first completion's, summed over the responses
    num_responses: int = 0
    texts: list[str] = field(default_factory=list)
    logprobs: Optional[list[dict[str, Any]]] = None
    cumulative_logprob: Optional[float] = None
    start: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None
    end: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)
    queue: Optional[dict[str, Any]] = None  # the last return_queue_info outputs seen

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.texts = [a + b for a, b in zip(self.texts, chunk.texts)] if self.texts else list(chunk.texts)
        self.token_ids.extend(chunk.token_ids)
        self.num_responses += 1
        self.num_input_tokens = chunk.num_input_tokens or self.num_input_tokens
        self.num_output_tokens += chunk.num_output_tokens
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        if chunk.cumulative_logprob is not None:
            self.cumulative_logprob = chunk.cumulative_logprob
        if chunk.queue is not None:
            self.queue = chunk.queue
        if chunk.token_ids or chunk.text:
            if self.first_token_time is None:
                self.first_token_time = chunk.time
            self.chunk_times.append(chunk.time)
        if chunk.finished:
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
