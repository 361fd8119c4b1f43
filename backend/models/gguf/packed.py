"""GGUF tensor data in ggml's block layouts -> the packed arrays of docs/quantization.md (numpy).

ggml stores a quantized row as blocks that interleave each block's scales with its codes, and the
K-quants pack their 6-bit sub-scales and order their nibbles each their own way
(``ggml-common.h``, ``dequantize_row_*`` in ``ggml-quants.c``). This module splits them into the
layout every inflight kernel reads: the low 4 bits of the codes in one nibble order for all types
(``qweight``), the higher bits as uint32 bit planes (``qhigh``), float16 scales and mins, byte-wide
sub-scales. No value changes: dequantizing the result (kernels/quant_reference.py) gives ggml's
floats to the bit, which tests/test_quant_layout.py checks against the ``gguf`` package.

Rows are converted a slice at a time (``ROWS_PER_SLICE``), so a large embedding's temporaries stay
small. No torch here: the importer runs without it until it writes.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

QK, QK_K = 32, 256  # values per group; per K-quant super-block

# ggml type ids (gguf.GGMLQuantizationType) of the types read here.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
FLOAT_TYPES = {F32: "F32", F16: "F16", BF16: "BF16"}
PACKED_TYPES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
                Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
TYPE_NAMES = {**FLOAT_TYPES, **PACKED_TYPES}
TYPE_IDS = {name: t for t, name in TYPE_NAMES.items()}
# type -> (values per block, bytes per block), as ggml's GGML_QUANT_SIZES.
BLOCK_SIZES = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q8_0: (QK, 34), Q4_0: (QK, 18),
               Q4_1: (QK, 20), Q5_0: (QK, 22), Q5_1: (QK, 24), Q4_K: (QK_K, 144),
               Q5_K: (QK_K, 176), Q6_K: (QK_K, 210)}
ROWS_PER_SLICE = 4096


def type_name(ggml_type: int) -> str:
    """The ggml name of a type id, also for types not read here."""
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(int(ggml_type)).name
    except (ImportError, ValueError):
        return TYPE_NAMES.get(int(ggml_type), f"type {int(ggml_type)}")


def supported_types() -> list[str]:
    return list(FLOAT_TYPES.values()) + list(PACKED_TYPES.values())


def tensor_bytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of numpy ``shape`` (outermost first) takes in a GGUF file."""
    per_block, nbytes = BLOCK_SIZES[int(ggml_type)]
    return math.prod(int(s) for s in shape) // per_block * nbytes  # Python ints: no overflow


# -- the shared pieces of the layout ---------------------------------------------------------------
def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block: [rows, blocks]."""
    return np.ascontiguousarray(blocks[:, :, start:start + 2]).view(np.float16)[:, :, 0]


def low_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [rows, K] (uint8) -> ``qweight`` [rows, K/2]: per group of 32, byte i holds value i in
    its low nibble and value i + 16 in its high nibble."""
    rows, k = q.shape
    groups = q.reshape(rows, k // QK, 2, QK // 2) & 0x0F
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(rows, k // 2)


def bit_plane(q: np.ndarray, bit: int) -> np.ndarray:
    """Bit ``bit`` of codes [rows, K] as one little-endian uint32 per group: [rows, K/32, 4] bytes."""
    rows, k = q.shape
    bits = ((q >> bit) & 1).reshape(rows, k // QK, QK).astype(np.uint8)
    return np.packbits(bits, axis=-1, bitorder="little")


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's 12-byte ``scales`` of Q4_K/Q5_K -> the 8 sub-scales and 8 sub-mins (6 bits each):
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for
    the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales, mins


def _k_low_codes(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K ``qs`` [rows, blocks, 128] -> the low 4 bits of each value [rows, blocks, 256]: per
    64 values, the low nibbles of 32 bytes are values 0..31 and their high nibbles values 32..63."""
    rows, nb = qs.shape[:2]
    chunks = qs.reshape(rows, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return (chunks & 0x0F).reshape(rows, nb, QK_K)


# -- per type: blocks [rows, blocks, bytes] -> arrays ----------------------------------------------
def _q8_0(b):
    return {"qweight": b[:, :, 2:].copy().view(np.int8).reshape(b.shape[0], -1), "scales": _f16(b, 0)}


def _q4_0(b):
    return {"qweight": b[:, :, 2:18].reshape(b.shape[0], -1), "scales": _f16(b, 0)}


def _q4_1(b):
    return {"qweight": b[:, :, 4:20].reshape(b.shape[0], -1), "scales": _f16(b, 0), "mins": _f16(b, 2)}


def _q5_0(b):
    return {"qweight": b[:, :, 6:22].reshape(b.shape[0], -1), "qhigh": b[:, :, 2:6].reshape(b.shape[0], -1),
            "scales": _f16(b, 0)}


def _q5_1(b):
    return {"qweight": b[:, :, 8:24].reshape(b.shape[0], -1), "qhigh": b[:, :, 4:8].reshape(b.shape[0], -1),
            "scales": _f16(b, 0), "mins": _f16(b, 2)}


def _q4_k_or_q5_k(b, fifth_bits: bool):
    rows, nb = b.shape[:2]
    sub_scales, sub_mins = _k_scale_min(b[:, :, 4:16])
    q = _k_low_codes(b[:, :, 48:176] if fifth_bits else b[:, :, 16:144])
    out = {"scales": _f16(b, 0), "mins": -_f16(b, 2),
           "sub_scales": sub_scales.reshape(rows, -1), "sub_mins": sub_mins.reshape(rows, -1)}
    if fifth_bits:  # qh[l] bit j is bit 4 of value l of group j
        qh = b[:, :, 16:48]
        bits = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
        q = q | (bits.reshape(rows, nb, QK_K) << 4)
        out["qhigh"] = bit_plane(q.reshape(rows, -1), 4).reshape(rows, -1)
    out["qweight"] = low_nibbles(q.reshape(rows, -1))
    return out


def _q6_k(b):
    rows, nb = b.shape[:2]
    ql = b[:, :, 0:128].reshape(rows, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[:, :, 128:192].reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    q = ((ql & 0x0F).reshape(rows, nb, 2, 128) | ((qh & 0x03).reshape(rows, nb, 2, 128) << 4))
    q = q.reshape(rows, -1)
    planes = np.concatenate([bit_plane(q, 4), bit_plane(q, 5)], axis=-1)  # [rows, groups, 8]
    return {"qweight": low_nibbles(q), "qhigh": planes.reshape(rows, -1),
            "scales": _f16(b, 208), "sub_scales": b[:, :, 192:208].copy().view(np.int8).reshape(rows, -1)}


_CONVERTERS: dict[int, Callable[[np.ndarray], dict[str, np.ndarray]]] = {
    Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1,
    Q4_K: lambda b: _q4_k_or_q5_k(b, False), Q5_K: lambda b: _q4_k_or_q5_k(b, True), Q6_K: _q6_k,
}


def pack(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """A quantized matrix's file data -> its packed arrays (docs/quantization.md).

    ``raw``: the tensor's bytes as the file stores them (any dtype; reinterpreted), ``shape`` its
    numpy shape [N, K]. Raises ValueError when the data does not fit the type and shape."""
    ggml_type = int(ggml_type)
    if ggml_type not in _CONVERTERS:
        raise ValueError(f"{type_name(ggml_type)} is not a packed type; packed: {', '.join(PACKED_TYPES.values())}")
    if len(shape) != 2:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {tuple(shape)}: only matrices are kept packed")
    rows, k = (int(s) for s in shape)
    per_block, nbytes = BLOCK_SIZES[ggml_type]
    if k % per_block:
        raise ValueError(f"{type_name(ggml_type)} rows of {k} values are not whole blocks of {per_block}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != tensor_bytes(ggml_type, (rows, k)):
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {(rows, k)} needs "
                         f"{tensor_bytes(ggml_type, (rows, k))} bytes; it has {data.size}")
    blocks = data.reshape(rows, k // per_block, nbytes)
    slices = [_CONVERTERS[ggml_type](blocks[start:start + ROWS_PER_SLICE])
              for start in range(0, rows, ROWS_PER_SLICE)]
    return {name: np.ascontiguousarray(np.concatenate([s[name] for s in slices])) for name in slices[0]}


def float_array(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """An F32/F16/BF16 tensor's data as a numpy array of ``shape`` (BF16 as its uint16 bits, which
    the writer reinterprets: numpy has no bfloat16)."""
    dtype = {F32: "<f4", F16: "<f2", BF16: "<u2"}[int(ggml_type)]
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if data.size != tensor_bytes(ggml_type, shape):
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {tuple(shape)} needs "
                         f"{tensor_bytes(ggml_type, shape)} bytes; it has {data.size}")
    return data.view(dtype).reshape(shape)
