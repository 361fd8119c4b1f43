"""Dequantize GGUF tensor data to float32 with numpy: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.

The block layouts are ggml's (``ggml-common.h``). Every quantized type stores its values in blocks
of 32 along a row (a row is GGUF dimension 0, the innermost one), each block led by an fp16 scale
``d`` (and, for the ``_1`` types, an fp16 minimum ``m``):

- ``Q8_0``: d, then 32 int8 values: ``x = d * q``.
- ``Q4_0``: d, then 16 bytes; the low nibbles are values 0..15 of the block, the high nibbles
  values 16..31: ``x = d * (q - 8)``.
- ``Q4_1``: d, m, then 16 bytes of nibbles as in Q4_0: ``x = d * q + m``.
- ``Q5_0``: d, 4 bytes holding the fifth bit of each of the 32 values, then nibbles as in Q4_0:
  ``x = d * (q - 16)``.
- ``Q5_1``: d, m, the fifth bits, nibbles: ``x = d * q + m``.

The arithmetic is done in float32 (the fp16 scales widened first), as ggml's reference
dequantization does, so the result is exact to what llama.cpp computes on CPU.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

QK = 32  # values per block for every quantized type here

# ggml type ids (GGMLQuantizationType in the gguf package) of the types we read.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30
TYPE_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1",
              Q5_0: "Q5_0", Q5_1: "Q5_1"}


def _f16(block: np.ndarray, start: int) -> np.ndarray:
    """Column of fp16 values at byte ``start`` of every block row, as float32 of shape (n, 1)."""
    return block[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 values 0..15: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes per block (a little-endian uint32) -> bit j of it for values j = 0..31, times 16."""
    bits = qh.copy().view("<u4").astype(np.uint32)  # (n, 1)
    return (((bits >> np.arange(QK, dtype=np.uint32)) & 1) << 4).astype(np.int32)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_nibbles(b[:, 2:]) - 8).astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6])
    return _f16(b, 0) * (q - 16).astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


# type -> (bytes per block, block decoder (n_blocks, bytes) -> (n_blocks, 32) float32)
_BLOCK_TYPES: dict[int, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    Q8_0: (2 + QK, _q8_0),
    Q4_0: (2 + QK // 2, _q4_0),
    Q4_1: (4 + QK // 2, _q4_1),
    Q5_0: (6 + QK // 2, _q5_0),
    Q5_1: (8 + QK // 2, _q5_1),
}


def type_name(ggml_type: int) -> str:
    """The ggml name of a type id (also for types we cannot read)."""
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        return TYPE_NAMES.get(int(ggml_type), f"type {int(ggml_type)}")


def supported_types() -> list[str]:
    return [TYPE_NAMES[t] for t in sorted(TYPE_NAMES)]


def dequantize(raw: np.ndarray, ggml_type: int, shape: Sequence[int]) -> np.ndarray:
    """The float32 array of ``shape`` (numpy order: outermost first) that ``raw`` encodes.

    ``raw`` is the tensor's data as stored in the file, in any dtype (it is reinterpreted as bytes).
    Raises ValueError naming the type for a type this module does not read.
    """
    ggml_type = int(ggml_type)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    shape = tuple(int(s) for s in shape)
    count = int(np.prod(shape)) if shape else 1
    if ggml_type == F32:
        out = data.view("<f4").astype(np.float32)
    elif ggml_type == F16:
        out = data.view("<f2").astype(np.float32)
    elif ggml_type == BF16:  # the top half of a float32
        out = (data.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif ggml_type in _BLOCK_TYPES:
        block_bytes, decode = _BLOCK_TYPES[ggml_type]
        if shape and shape[-1] % QK:
            raise ValueError(f"{type_name(ggml_type)} tensor rows of {shape[-1]} values are not "
                             f"whole blocks of {QK}")
        if data.size != count // QK * block_bytes:
            raise ValueError(f"{type_name(ggml_type)} tensor of shape {shape} needs "
                             f"{count // QK * block_bytes} bytes, the file has {data.size}")
        out = decode(data.reshape(-1, block_bytes))
    else:
        raise ValueError(f"GGUF tensor type {type_name(ggml_type)} is not supported; supported: "
                         f"{', '.join(supported_types())}")
    if out.size != count:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {shape} has {out.size} values")
    return out.reshape(shape)
