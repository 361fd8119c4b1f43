"""What both mmproj importers (mmproj.py: Gemma 3; mmproj_qwen.py: Qwen2.5-VL) read and write alike:
a tensor as float32, the per-channel image mean / std keys, the weight index of a sharded folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from backend.models.checkpoint_config import Reader
from backend.models.gguf.mapping import GGUFImportError, float32_decimal
from backend.models.gguf.packed import FLOAT_TYPES, PACKED_TYPES, float_array, pack


def three(r: Reader, key: str, default: float) -> tuple[float, ...]:
    value = r.cfg.get(key, [default] * 3)
    if not isinstance(value, list) or len(value) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in value):
        r.fail(key, value, "three finite numbers (one per RGB channel)")
    return tuple(float32_decimal(v) for v in value)  # (0.48145467, not 0.48145467042922974)


def float32_tensor(tensor):
    """One mmproj tensor (a gguf reader's) as float32 torch in its numpy shape, quantized ones dequantized."""
    import torch
    ggml_type, shape = int(tensor.tensor_type), tuple(reversed([int(s) for s in tensor.shape]))
    try:
        if ggml_type in PACKED_TYPES:
            from kernels.quant_reference import dequantize
            arrays = pack(tensor.data, ggml_type, shape)
            value = dequantize(PACKED_TYPES[ggml_type], {k: torch.from_numpy(v) for k, v in arrays.items()})
        elif FLOAT_TYPES[ggml_type] == "BF16":  # numpy has no bfloat16: its bits
            bits = float_array(tensor.data, ggml_type, shape)
            value = torch.from_numpy(np.array(bits).view(np.int16)).view(torch.bfloat16)
        else:
            value = torch.from_numpy(np.array(float_array(tensor.data, ggml_type, shape)))
    except ValueError as exc:
        raise GGUFImportError(f"mmproj tensor {tensor.name}: {exc}") from None
    return value.float().reshape(shape).contiguous()


def add_to_index(folder: Path, tensors: Mapping[str, Any]) -> None:
    """mmproj.safetensors's tensors in the text weights' index, when they are sharded."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        data["weight_map"].update(dict.fromkeys(tensors, "mmproj.safetensors"))
        index.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def check_shapes_against(shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], name: str,
                         beyond: str) -> None:
    """Each tensor of the file one the metadata implies (`expected`), with that shape, and none
    missing; `beyond`: why a tensor with no expected shape is refused (after its name)."""
    for tensor, shape in shapes.items():
        want = expected.get(tensor)
        if want is None:
            raise GGUFImportError(f"{name}: tensor {tensor} {beyond}")
        if tuple(shape) != want:
            raise GGUFImportError(f"{name}: tensor {tensor} has shape {list(shape)}; the metadata implies {list(want)}")
    missing = [t for t in expected if t not in shapes]
    if missing:
        raise GGUFImportError(f"{name}: {len(missing)} tensor(s) the metadata implies are missing, e.g. "
                              f"{', '.join(missing[:3])}")
