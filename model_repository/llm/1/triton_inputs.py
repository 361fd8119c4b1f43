"""A request's input tensors (numpy arrays by name) -> prompt, `SamplingParams` and flags, or a
`ValueError` that says what is wrong and what is allowed; and the error (with its Triton code) a
refused request is answered with. No Triton imports: unit-tested without a server."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import numpy as np

from backend.request import MAX_STOP_STRINGS, SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_SAMPLING_PARAMETERS_BYTES = 1 << 20  # the sampling_parameters JSON
INPUT_NAMES = ("text_input", "input_ids", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed",
               "stop_words", "ignore_eos", "min_tokens", "exclude_input_in_output", "stop",
               "sampling_parameters")
# Request parameters Triton itself may attach; any other parameter is refused (see check_parameters).
KNOWN_PARAMETERS = ("id", "priority", "timeout", "sequence_id", "sequence_start", "sequence_end")
SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_words",
                 "stop_token_ids", "ignore_eos", "min_tokens")


# -- one request's tensors ---------------------------------------------------------------------------

@dataclass
class ParsedRequest:
    prompt: Union[str, list[int], None] = None
    params: Optional[SamplingParams] = None
    stream: bool = False
    exclude_input: bool = False
    stop: bool = False  # a request that cancels the running request with the same request id


def _one(name: str, array: np.ndarray) -> Any:
    if array.size != 1:
        raise ValueError(f"{name} must hold exactly one value; got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _int(name: str, array: np.ndarray) -> int:
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an integer tensor; got {array.dtype}")
    return int(_one(name, array))


def _float(name: str, array: np.ndarray) -> float:
    if array.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a number tensor; got {array.dtype}")
    return float(_one(name, array))


def _bool(name: str, array: np.ndarray) -> bool:
    if array.dtype.kind != "b":
        raise ValueError(f"{name} must be a BOOL tensor; got {array.dtype}")
    return bool(_one(name, array))


def _text(name: str, value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"{name} must be a BYTES (string) tensor; got {type(value).__name__}")


def _strings(name: str, array: np.ndarray) -> list[str]:
    if array.dtype.kind not in "OSU":
        raise ValueError(f"{name} must be a BYTES (string) tensor; got {array.dtype}")
    return [_text(name, v) for v in array.reshape(-1)]


def parse_request(inputs: Mapping[str, Optional[np.ndarray]], vocab_size: int,
                  max_model_len: Optional[int] = None, max_input_bytes: Optional[int] = None) -> ParsedRequest:
    """Validate the input tensors of one request. Raises ValueError naming the input and the rule.

    The size limits are checked before anything is decoded or copied: `max_input_bytes` on the
    text_input, `max_model_len` on the number of input_ids, and the stop-word count."""
    get = {k: v for k, v in inputs.items() if v is not None}
    if "stop" in get and _bool("stop", get["stop"]):
        return ParsedRequest(stop=True)

    text, ids = get.get("text_input"), get.get("input_ids")
    if text is not None and ids is not None:
        raise ValueError("send either text_input or input_ids, not both")
    if text is None and ids is None:
        raise ValueError("no prompt: send text_input (BYTES) or input_ids (INT32 [n])")
    prompt: Union[str, list[int]]
    if text is not None:
        if text.dtype.kind not in "OSU":
            raise ValueError(f"text_input must be a BYTES (string) tensor; got {text.dtype}")
        raw = _one("text_input", text)
        if max_input_bytes and isinstance(raw, (bytes, np.bytes_, str)) and len(raw) > max_input_bytes:
            size = len(raw) if not isinstance(raw, str) else len(raw.encode("utf-8"))
            if size > max_input_bytes:
                raise ValueError(f"text_input is {size} bytes; the limit is {max_input_bytes} bytes "
                                 f"(max_input_bytes" + (f"; max_model_len is {max_model_len} tokens)"
                                                        if max_model_len else ")"))
        prompt = _text("text_input", raw)
        if not prompt:
            raise ValueError("text_input is empty: the prompt needs at least one character")
    else:
        if ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be an INT32 tensor; got {ids.dtype}")
        if ids.ndim != 1:
            raise ValueError(f"input_ids must be one-dimensional [n]; got shape {list(ids.shape)}")
        if ids.size == 0:
            raise ValueError("input_ids is empty: the prompt needs at least one token")
        if max_model_len and ids.size > max_model_len:
            raise ValueError(f"prompt has {ids.size} tokens; max_model_len is {max_model_len}")
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise ValueError(f"input_ids: token id {int(bad[0])} is outside the vocabulary "
                             f"[0, {vocab_size})")
        prompt = [int(t) for t in ids]

    kwargs: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    if "sampling_parameters" in get:
        raw = _one("sampling_parameters", get["sampling_parameters"])
        if isinstance(raw, (bytes, np.bytes_, str)) and len(raw) > MAX_SAMPLING_PARAMETERS_BYTES:
            raise ValueError(f"sampling_parameters is {len(raw)} bytes; the limit is "
                             f"{MAX_SAMPLING_PARAMETERS_BYTES} bytes")
        kwargs.update(_sampling_json(_text("sampling_parameters", raw)))
    for name, conv in (("max_tokens", _int), ("top_k", _int), ("min_tokens", _int), ("seed", _int),
                       ("temperature", _float), ("top_p", _float), ("ignore_eos", _bool)):
        if name in get:
            kwargs[name] = conv(name, get[name])
    if "stop_words" in get:
        if get["stop_words"].size > MAX_STOP_STRINGS:
            raise ValueError(f"stop_words: at most {MAX_STOP_STRINGS} stop strings; got {get['stop_words'].size}")
        kwargs["stop"] = _strings("stop_words", get["stop_words"])
    if kwargs["max_tokens"] < 1:
        hint = (" (max_tokens is an INT32: a value past 2147483647 wraps around to a negative one)"
                if kwargs["max_tokens"] < 0 else "")
        raise ValueError(f"max_tokens must be >= 1; got {kwargs['max_tokens']}{hint}")
    for name in ("temperature", "top_p"):
        if name in kwargs and math.isnan(kwargs[name]):
            raise ValueError(f"{name} must be a number; got NaN")
    params = SamplingParams(**kwargs)  # raises ValueError with the field and its range
    return ParsedRequest(prompt=prompt, params=params,
                         stream=_bool("stream", get["stream"]) if "stream" in get else False,
                         exclude_input=(_bool("exclude_input_in_output", get["exclude_input_in_output"])
                                        if "exclude_input_in_output" in get else False))


def check_parameters(raw: Optional[str]) -> None:
    """Refuse request parameters the model does not know. Triton's HTTP generate endpoints turn
    every JSON field that is not an input into a request parameter, so a misspelt option
    ("max_token": 100) would otherwise be dropped without a word. Over gRPC, unknown inputs are
    refused by Triton itself."""
    if not raw or raw == "{}":
        return
    try:
        params = json.loads(raw)
    except ValueError:
        return
    if not isinstance(params, dict):
        return
    unknown = sorted(k for k in params if k not in KNOWN_PARAMETERS and not k.startswith("triton_"))
    if unknown:
        raise ValueError(f"unknown input(s) {', '.join(repr(k) for k in unknown)}; the inputs are "
                         f"{', '.join(INPUT_NAMES)} (over HTTP generate, a JSON field that is not an "
                         "input arrives as a request parameter: check its spelling)")


def _sampling_json(raw: str) -> dict[str, Any]:
    """The vLLM backend's `sampling_parameters` JSON (values may be strings, as that backend allows)."""
    try:
        data = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"sampling_parameters is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("sampling_parameters must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in SAMPLING_KEYS:
            raise ValueError(f"sampling_parameters: unknown key '{key}'; allowed: {', '.join(SAMPLING_KEYS)}")
        try:
            if key in ("max_tokens", "top_k", "min_tokens", "seed"):
                out[key] = int(value)
            elif key in ("temperature", "top_p"):
                out[key] = float(value)
            elif key == "ignore_eos":
                out[key] = value if isinstance(value, bool) else str(value).lower() in ("1", "true")
            elif key in ("stop", "stop_words"):
                out["stop"] = [value] if isinstance(value, str) else [str(v) for v in value]
            elif key == "stop_token_ids":
                out[key] = [int(v) for v in value]
        except (TypeError, ValueError):
            raise ValueError(f"sampling_parameters: bad value for '{key}': {value!r}") from None
    return out


# -- errors ----------------------------------------------------------------------------------------

class Error(str):
    """An error message for a client, with the Triton error code to answer it with.

    INVALID_ARG: the request is wrong (fix it; gRPC INVALID_ARGUMENT, HTTP 400).
    UNAVAILABLE: the server cannot take it now (the queue is full, it is shutting down): retry later.
    INTERNAL: the server failed it (a failed model step)."""
    code: str

    def __new__(cls, message: str, code: str = "INTERNAL") -> "Error":
        self = super().__new__(cls, message)
        self.code = code
        return self


class ServerClosing(RuntimeError):
    """The model is being unloaded: new requests are refused."""


def error_for(exc: BaseException) -> Error:
    """The message and code a refused request gets for an exception."""
    if isinstance(exc, ValueError):
        return Error(str(exc) or type(exc).__name__, "INVALID_ARG")
    # QueueFullError and EngineDeadError live in backend.engine, which this module does not import
    # (it would load torch before the config is checked): they are known by name.
    if isinstance(exc, ServerClosing) or type(exc).__name__ in ("QueueFullError", "EngineDeadError"):
        return Error(str(exc) or type(exc).__name__, "UNAVAILABLE")
    return Error(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, "INTERNAL")
