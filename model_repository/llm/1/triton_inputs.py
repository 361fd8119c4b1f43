"""A request's input tensors (numpy arrays by name) and request parameters -> prompt,
`SamplingParams` and flags, or a `ValueError` that says what is wrong and what is allowed (the
error a refused request is answered with, and its Triton code: triton_errors.py). No Triton
imports: unit-tested without a server. One tensor's value is read by tensor_values.py, the
TensorRT-LLM inputs that are not sampling keys by trtllm_inputs.py.

This layer only converts: tensors and JSON into one dict of vLLM sampling keys, which
`SamplingParams.from_dict` checks (every value check lives there, and the prompt's length and
token ids are checked by the engine's `make_request`). What runs here is what must run before
anything is decoded: the byte caps, the dtype and shape of each tensor, and the request's form
(stream, exclude_input_in_output, the TensorRT-LLM inputs we cannot honour).

Where the sampling settings come from, as the vLLM backend reads them: the `sampling_parameters`
tensor when present, else the request's parameters (gRPC `parameters=`, the JSON fields of HTTP
generate); an explicit input tensor (`max_tokens`, `temperature`, ...) wins over both.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import numpy as np

from backend.core import defaults
from backend.core.images import base64_bytes
from backend.core.input_guard import check_text, guarded, int32
from backend.core.sampling_params import SamplingParams
from openai_server.reasoning import PARSERS as REASONING_PARSERS
from templates.tensors import INPUTS, RETURN_FLAGS
from tensor_values import KIND, byte_cap, one_value, tensor_strings, tensor_text, tensor_value
from trtllm_inputs import Encode, embedding_bias, trtllm_inputs

DEFAULT_MAX_TOKENS = defaults.MAX_TOKENS  # where neither the JSON nor a tensor names max_tokens
MAX_SAMPLING_PARAMETERS_BYTES = 1 << 20  # the sampling_parameters JSON, and the request parameters
INPUT_NAMES = tuple(t.name for t in INPUTS)
# Request parameters Triton itself may attach: never sampling settings.
KNOWN_PARAMETERS = ("id", "priority", "timeout", "sequence_id", "sequence_start", "sequence_end")
# The inputs that set a sampling key, and the key (the TensorRT-LLM names map onto the same keys).
_SAMPLING_INPUTS = {t.name: t.key for t in INPUTS if t.key is not None}
# vLLM backend sampling keys we do not support: refused by name rather than silently dropped.
_UNSUPPORTED_KEYS: dict[str, str] = {}  # (beam search's keys are served since issue 43)


@dataclass
class ParsedRequest:
    prompt: Union[str, list[int], None] = None
    params: Optional[SamplingParams] = None
    stream: bool = False
    exclude_input: bool = False
    stop: bool = False  # a request that cancels the running request with the same request id
    priority: int = 0
    returns: frozenset = field(default_factory=frozenset)  # the return_* flags set to true
    lora_name: Optional[str] = None  # the LoRA adapter (the vLLM backend's sampling key)
    reasoning_parser: Optional[str] = None  # the thinking split off into reasoning_output
    pooling_task: Optional[str] = None  # embed | classify (pooling_door.py)
    dimensions: Optional[int] = None  # pooling: a Matryoshka embedding's size
    images: list = field(default_factory=list)  # the `image` input's files (bytes), decoded by the engine

    @property
    def engine_prompt(self) -> Any:
        """The prompt as the engine takes it: with its images in vLLM's shape (docs/vision.md)."""
        if not self.images:
            return self.prompt
        key = "prompt" if isinstance(self.prompt, str) else "prompt_token_ids"
        return {key: self.prompt, "multi_modal_data": {"image": self.images}}


def _prompt(get: Mapping[str, np.ndarray], max_input_bytes: Optional[int],
            max_model_len: Optional[int]) -> Union[str, list[int]]:
    text, ids = get.get("text_input"), get.get("input_ids")
    if text is not None and ids is not None:
        raise ValueError("send either text_input or input_ids, not both")
    if text is None and ids is None:
        raise ValueError("no prompt: send text_input (BYTES) or input_ids (INT32 [n])")
    if text is not None:
        if text.dtype.kind not in "OSU":
            raise ValueError(f"text_input must be a BYTES (string) tensor; got {text.dtype}")
        raw = one_value("text_input", text)
        if max_input_bytes:
            byte_cap("text_input", raw, max_input_bytes, " (max_input_bytes" + (
                f"; max_model_len is {max_model_len} tokens)" if max_model_len else ")"))
        prompt = tensor_text("text_input", raw)
        if not prompt:
            raise ValueError("text_input is empty: the prompt needs at least one character")
        return prompt
    if ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be an INT32 tensor; got {ids.dtype}")
    if ids.ndim == 2 and ids.shape[0] == 1:  # the TensorRT-LLM form: [1, n]
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"input_ids must be one-dimensional [n]; got shape {list(ids.shape)}")
    return [int(t) for t in ids]


MAX_IMAGE_ELEMENTS = 1024  # the `image` input's elements, checked before any is decoded


def _images(get: Mapping[str, np.ndarray]) -> list[bytes]:
    """The `image` input (base64 strings, the vLLM backend's) as the image files' bytes; the engine
    checks the count against limit_mm_per_prompt before decoding any (backend/engine/images.py)."""
    if "image" not in get:
        return []
    array = get["image"]
    if array.dtype.kind not in "OSU":
        raise ValueError(f"image must be a BYTES (string) tensor of base64 images; got {array.dtype}")
    if array.size > MAX_IMAGE_ELEMENTS:
        raise ValueError(f"image: at most {MAX_IMAGE_ELEMENTS} elements; got {array.size}")
    return [base64_bytes(v.decode("latin-1") if isinstance(v, bytes) else str(v), f"image[{i}]")
            for i, v in enumerate(array.reshape(-1))]


def _json_object(name: str, raw: str) -> dict[str, Any]:
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise ValueError(f"{name} is not valid JSON: {exc}") from None
    except RecursionError:  # json's scanner recurses once per nesting level
        raise ValueError(f"{name} is nested too deeply to be sampling settings") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name} must be a JSON object")
    check_text(data, name)  # "\ud800" is valid JSON and no valid text
    return data


def _check_keys(source: str, data: Mapping[str, Any]) -> None:
    """Refuse, by name, what the vLLM backend accepts and we do not support, and any other key that
    is not a sampling key (SamplingParams.from_dict then checks the values)."""
    for key in data:
        if key in _UNSUPPORTED_KEYS:
            raise ValueError(f"{source}: '{key}' is refused: {_UNSUPPORTED_KEYS[key]}")
    unknown = sorted(k for k in data if k not in SamplingParams.KEYS)
    if unknown:
        hint = (" (over HTTP generate, a JSON field that is not an input arrives as a request parameter: "
                "check its spelling)" if source == "request parameters" else "")
        raise ValueError(f"{source}: unknown input(s) or sampling key(s) {', '.join(repr(k) for k in unknown)}; "
                         f"the inputs are {', '.join(INPUT_NAMES)}; the sampling keys are "
                         f"{', '.join(SamplingParams.KEYS)}{hint}")


def _request_parameters(raw: Optional[str]) -> dict[str, Any]:
    """The request's parameters without the ones Triton itself attaches."""
    if not raw or raw == "{}":
        return {}
    if len(raw) > MAX_SAMPLING_PARAMETERS_BYTES:
        raise ValueError(f"the request parameters are {len(raw)} bytes; the limit is "
                         f"{MAX_SAMPLING_PARAMETERS_BYTES} bytes")
    data = _json_object("the request parameters", raw)
    return {k: v for k, v in data.items() if k not in KNOWN_PARAMETERS and not k.startswith("triton_")}


def parse_request(inputs: Mapping[str, Optional[np.ndarray]], parameters: Optional[str] = None,
                  max_input_bytes: Optional[int] = None, max_model_len: Optional[int] = None,
                  vocab_size: Optional[int] = None, encode: Optional[Encode] = None) -> ParsedRequest:
    """Convert one request's tensors and parameters. Raises ValueError naming the input and the rule.

    `parameters` is the request's parameters as Triton gives them (a JSON object). The byte caps
    run before anything is decoded: `max_input_bytes` on text_input, 1 MiB on the sampling JSON.
    `max_model_len` only goes into the message of the first; `vocab_size` bounds end_id; `encode`
    tokenizes TensorRT-LLM's embedding_bias_words. What
    hostile JSON makes Python raise (nesting, 1e400, lone surrogates) is a ValueError too
    (backend/core/input_guard.py)."""
    with guarded("the request's inputs and parameters"):
        return _parse(inputs, parameters, max_input_bytes, max_model_len, vocab_size, encode)


def _parse(inputs: Mapping[str, Optional[np.ndarray]], parameters: Optional[str], max_input_bytes: Optional[int],
           max_model_len: Optional[int], vocab_size: Optional[int], encode: Optional[Encode]) -> ParsedRequest:
    get = {k: v for k, v in inputs.items() if v is not None}
    request_params = _request_parameters(parameters)
    priority = request_params.pop("priority", 0)  # an argument of add_request, not a sampling key
    returns = frozenset(n for n in RETURN_FLAGS if n in get and tensor_value(n, get[n]))
    if "stop" in get and tensor_value("stop", get["stop"]):
        return ParsedRequest(stop=True, returns=returns)
    prompt = _prompt(get, max_input_bytes, max_model_len)

    if "sampling_parameters" in get:  # as the vLLM backend: the tensor, else the request parameters
        raw = one_value("sampling_parameters", get["sampling_parameters"])
        byte_cap("sampling_parameters", raw, MAX_SAMPLING_PARAMETERS_BYTES)
        sampling = _json_object("sampling_parameters", tensor_text("sampling_parameters", raw))
        priority = sampling.pop("priority", priority)
        lora_name = sampling.pop("lora_name", request_params.pop("lora_name", None))
        _check_keys("sampling_parameters", sampling)
        # The vLLM backend then ignores the request parameters; a misspelt one is still refused.
        _check_keys("request parameters", request_params)
        source = "sampling_parameters"
    else:
        sampling = request_params
        lora_name = sampling.pop("lora_name", None)
        _check_keys("request parameters", sampling)
        source = "request parameters"
    sampling.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    if "stop_words" in sampling and "stop" in sampling:
        raise ValueError(f"{source}: send stop or stop_words, not both (stop_words is an alias)")

    for name, key in _SAMPLING_INPUTS.items():  # explicit tensors win
        if name in get:
            value = tensor_strings(name, get[name]) if KIND[name] == "STRING" else tensor_value(name, get[name])
            if key == "stop":
                sampling.pop("stop_words", None)
            sampling[key] = value
    trtllm_inputs(get, sampling, vocab_size)
    embedding_bias(get, sampling, encode)
    if "priority" in get:
        priority = tensor_value("priority", get["priority"])
    priority = int32(priority, "priority")

    try:
        with guarded(source):
            params = SamplingParams.from_dict(sampling)  # every value check, naming the field and its limit
    except ValueError as exc:
        if "max_tokens" in get and sampling["max_tokens"] < 0 and str(exc).startswith("max_tokens"):
            # Not a second check: why a client that sent a huge number sees a negative one.
            raise ValueError(f"{exc} (max_tokens is an INT32: a value past 2147483647 wraps around to a "
                             "negative one)") from None
        raise

    stream = tensor_value("stream", get["stream"]) if "stream" in get else False
    exclude = tensor_value("exclude_input_in_output", get["exclude_input_in_output"]) \
        if "exclude_input_in_output" in get else None
    if stream and exclude is False:  # the vLLM backend's rule and message
        raise ValueError("When streaming, `exclude_input_in_output` = False is not allowed.")
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        # "" would otherwise run the base model: a client that meant an adapter would never know
        raise ValueError(f"{source}: lora_name must be a loaded adapter's name (omit it for the base model); "
                         f"got {lora_name!r}")
    reasoning = tensor_value("reasoning_parser", get["reasoning_parser"]) if "reasoning_parser" in get else None
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {reasoning!r}")
    task = tensor_value("pooling_task", get["pooling_task"]) if "pooling_task" in get else None
    if task is not None and task not in ("embed", "classify"):
        raise ValueError(f"pooling_task must be embed or classify; got {task!r}")
    return ParsedRequest(prompt=prompt, params=params, stream=stream, images=_images(get),
                         exclude_input=bool(stream or exclude), priority=priority, returns=returns,
                         lora_name=lora_name, reasoning_parser=reasoning, pooling_task=task,
                         dimensions=tensor_value("dimensions", get["dimensions"]) if "dimensions" in get else None)


