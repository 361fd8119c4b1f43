"""One input tensor's value, read with the checks that run before anything is decoded: its dtype
against the input's declared type (templates/tensors.py), its shape (one value, in any shape), its
text as UTF-8, a string list's count against SamplingParams' limit, a value's bytes against a cap.
No Triton imports (triton_inputs.py and trtllm_inputs.py read their tensors through it)."""
from __future__ import annotations

from typing import Any

import numpy as np

from backend.core.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP_STRINGS
from templates.tensors import INPUTS

KIND = {t.name: t.data_type for t in INPUTS}  # each input's declared type: BOOL, FP32, STRING, INT32, ...


def one_value(name: str, array: np.ndarray) -> Any:
    """A tensor's one value, in any shape: [1] as the vLLM backend sends it, [1, 1] as the TensorRT-LLM
    format does."""
    if array.size != 1:
        raise ValueError(f"{name} must hold exactly one value; got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def tensor_value(name: str, array: np.ndarray) -> Any:
    """The one value of a scalar input, as a Python value of its declared type."""
    kind = KIND[name]
    want = {"BOOL": "b", "FP32": "fiu", "STRING": "OSU"}.get(kind, "iu")
    if array.dtype.kind not in want:
        raise ValueError(f"{name} must be a TYPE_{kind} tensor; got {array.dtype}")
    value = one_value(name, array)
    if kind == "BOOL":
        return bool(value)
    if kind == "FP32":
        return float(value)
    if kind == "STRING":
        return tensor_text(name, value)
    return int(value)


def tensor_text(name: str, value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"{name} must be a BYTES (string) tensor; got {type(value).__name__}")


# The string-list inputs: SamplingParams' limit on each (checked here too, before decoding them).
LIST_LIMITS = {"stop_words": (MAX_STOP_STRINGS, "stop strings"), "bad_words": (MAX_BAD_WORDS, "bad words"),
                "embedding_bias_words": (MAX_LOGIT_BIAS, "words")}


def tensor_strings(name: str, array: np.ndarray) -> list[str]:
    if array.dtype.kind not in "OSU":
        raise ValueError(f"{name} must be a BYTES (string) tensor; got {array.dtype}")
    most, what = LIST_LIMITS[name]
    if array.size > most:  # a byte cap in effect: before decoding any of them
        raise ValueError(f"{name}: at most {most} {what}; got {array.size}")
    return [tensor_text(name, v) for v in array.reshape(-1)]


def byte_cap(name: str, raw: Any, limit: int, what: str = "") -> None:
    if isinstance(raw, (bytes, np.bytes_, str)) and len(raw) > limit:
        size = len(raw.encode("utf-8")) if isinstance(raw, str) else len(raw)
        if size > limit:
            raise ValueError(f"{name} is {size} bytes; the limit is {limit} bytes{what}")
