"""GGUF tensors to a checkpoint folder's safetensors: each tensor under its Hugging Face name, float
(``P.weight``, in the file's type or --dequantize's) or kept packed (``P.qweight``... in
docs/quantization.md's layout, backend/models/gguf/packed.py), Llama-family q/k rows unpermuted,
stacked experts packed as one module or written per expert, in shards of at most 2 GiB converted
one at a time from the memory-mapped file. backend/models/gguf/importer.py calls `write_weights`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from backend.models.gguf.mapping import (GEMMA_NORM_SHIFT, MOE_TENSORS, PERMUTED_ARCHITECTURES, ROPE_FREQS,
                                         GGUFImportError, hf_tensor_name, unpermute_rows)
from backend.models.gguf.packed import FLOAT_TYPES, PACKED_TYPES, float_array, pack

__all__ = ["OUTPUT_DTYPES", "float_file_dtype", "numpy_shape", "save_safetensors", "to_torch", "write_json",
           "write_weights"]

OUTPUT_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # --dequantize: bytes per value
SHARD_BYTES = 2 << 30


def numpy_shape(tensor) -> tuple[int, ...]:
    return tuple(reversed([int(s) for s in tensor.shape]))  # GGUF lists dimensions innermost first


def _tensor_arrays(tensor, config: dict[str, Any], arch: str,
                   dequantize_to: Optional[str]) -> dict[str, Any]:
    """One GGUF tensor as the folder's tensors: ``P.weight`` (float), or ``P.qweight``... (packed);
    stacked experts [E, N, K] packed as one [E, ...] module, or float as E per-expert tensors."""
    name, ggml_type, shape = hf_tensor_name(tensor.name, arch), int(tensor.tensor_type), numpy_shape(tensor)
    experts = len(shape) == 3 and tensor.name.rsplit(".", 2)[-2] in MOE_TENSORS
    try:
        if ggml_type not in PACKED_TYPES:
            arrays = {"weight": float_array(tensor.data, ggml_type, shape)}
        elif len(shape) == 2 or experts:   # experts: the E matrices as one of E * N rows, then apart
            arrays = pack(tensor.data, ggml_type, (math.prod(shape[:-1]), shape[-1]))
            arrays = {k: v.reshape(*shape[:-1], -1) for k, v in arrays.items()}
        else:
            raise ValueError(f"a quantized tensor of {len(shape)} dimensions (only matrices and stacked "
                             "experts are)")
    except ValueError as exc:
        raise GGUFImportError(f"tensor {tensor.name}: {exc}") from None
    if experts and (ggml_type not in PACKED_TYPES or dequantize_to is not None):
        return _expert_tensors(name, arrays, ggml_type, dequantize_to)
    heads = ("num_attention_heads" if ".q_proj." in name else
             "num_key_value_heads" if ".k_proj." in name else None)
    if arch in PERMUTED_ARCHITECTURES and heads:
        arrays = {k: unpermute_rows(v, config[heads]) for k, v in arrays.items()}
    prefix = name.rsplit(".", 1)[0]
    if ggml_type not in PACKED_TYPES:
        tensor_ = to_torch(arrays["weight"], ggml_type, dequantize_to)
        if arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp stored 1 + w (mapping.py)
            tensor_ = (tensor_.float() - GEMMA_NORM_SHIFT).to(tensor_.dtype)
        return {name: tensor_}
    if dequantize_to is None:
        return {f"{prefix}.{k}": to_torch(v) for k, v in arrays.items()}
    from kernels.quant_reference import dequantize
    parts = {k: to_torch(v) for k, v in arrays.items()}
    return {name: _to_dtype(dequantize(PACKED_TYPES[ggml_type], parts), dequantize_to)}


def _expert_tensors(name: str, arrays: dict[str, np.ndarray], ggml_type: int,
                    dequantize_to: Optional[str]) -> dict[str, Any]:
    """Stacked experts written as float per-expert tensors, ``...experts.{e}.w1.weight`` (a float
    file's, or --dequantize)."""
    if ggml_type in PACKED_TYPES:
        from kernels.quant_reference import dequantize
        parts = {k: to_torch(v).flatten(0, 1) for k, v in arrays.items()}
        count, rows = arrays["qweight"].shape[:2]
        stacked = _to_dtype(dequantize(PACKED_TYPES[ggml_type], parts), dequantize_to).unflatten(0, (count, rows))
    else:
        stacked = to_torch(arrays["weight"], ggml_type, dequantize_to)
    base, _, part = name.removesuffix(".weight").rpartition(".")
    return {f"{base}.{e}.{part}.weight": stacked[e].contiguous() for e in range(stacked.shape[0])}


def to_torch(array: np.ndarray, ggml_type: Optional[int] = None, dtype: Optional[str] = None):
    import torch
    if ggml_type is not None and FLOAT_TYPES.get(ggml_type) == "BF16":  # numpy has no bfloat16
        tensor = torch.from_numpy(np.array(array).view(np.int16)).view(torch.bfloat16)
    else:  # a view of the read-only file map is copied (torch wants writable memory)
        tensor = torch.from_numpy(array if array.flags.writeable else np.array(array))
    return tensor if dtype is None else _to_dtype(tensor.float(), dtype)


def _to_dtype(tensor, dtype: str):
    import torch
    return tensor.to(getattr(torch, dtype)).contiguous()


def float_file_dtype(tensors) -> dict[str, str]:
    """A float file's config keys: ``torch_dtype`` (its matrices' shared type, float32 for a mix) and
    for an F16/BF16 file ``gguf_float_type``: dtype=auto keeps that type on the CPU too (resolve_dtype)."""
    floats = {FLOAT_TYPES[int(t.tensor_type)] for t in tensors if len(t.shape) == 2}
    kind = floats.pop() if len(floats) == 1 else "F32"
    dtype = {"F16": "float16", "BF16": "bfloat16"}.get(kind, "float32")
    return {"torch_dtype": dtype, **({"gguf_float_type": kind} if dtype != "float32" else {})}


def _shards(tensors: list, nbytes) -> list[list]:
    """Tensors grouped in file order into shards of at most SHARD_BYTES (a bigger one alone)."""
    shards: list[list] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + nbytes(tensor) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes(tensor)
    return shards


def save_safetensors(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates the file owner-only; a server user must read it


def write_weights(reader, config: dict[str, Any], arch: str, folder: Path,
                  dequantize_to: Optional[str]) -> dict[str, str]:
    """Every tensor into ``folder`` under HF names, one shard at a time; returns the quantized
    modules (HF name without ``.weight`` -> GGUF type) that stay packed."""
    weights = [t for t in reader.tensors if t.name != ROPE_FREQS]
    if dequantize_to is None:
        nbytes = lambda t: int(t.data.nbytes)  # noqa: E731  (packed: about the file's bytes)
    else:
        nbytes = lambda t: int(np.prod(numpy_shape(t))) * OUTPUT_DTYPES[dequantize_to]  # noqa: E731
    shards = _shards(weights, nbytes)
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, 1):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{index:05d}-of-{len(shards):05d}.safetensors")
        tensors: dict[str, Any] = {}
        for t in shard:
            tensors.update(_tensor_arrays(t, config, arch, dequantize_to))
        save_safetensors(tensors, folder / file)
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        write_json(folder / "model.safetensors.index.json",
                    {"metadata": {"total_size": sum(nbytes(t) for t in weights)}, "weight_map": weight_map})
    if dequantize_to is not None:
        return {}
    return {hf_tensor_name(t.name, arch).rsplit(".", 1)[0]: PACKED_TYPES[int(t.tensor_type)]
            for t in weights if int(t.tensor_type) in PACKED_TYPES}


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
