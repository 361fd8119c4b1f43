"""``inflight import-gguf FILE.gguf --out DIR``: a GGUF file (llama.cpp, Ollama) to a Hugging Face
checkpoint folder that the engine loads.

The folder gets ``config.json`` (with ``architectures``), the dequantized weights under HF names
(``model.safetensors``, or 2 GiB shards with ``model.safetensors.index.json`` for large models),
``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template) and
``generation_config.json``. Only the ``gguf`` reader, numpy, safetensors and tokenizers are used:
no transformers, nothing downloaded, nothing executed from the file.

Dequantization is backend/gguf_dequant.py, the meaning of names and keys backend/gguf_mapping.py.
The file is memory-mapped and converted one shard at a time, so memory stays near one shard even
for a model larger than RAM in float32. The result is checked against transformers' own GGUF
loader, tensor for tensor, in tests/test_gguf_import.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from backend.gguf_dequant import TYPE_NAMES, dequantize, supported_types, type_name
from backend.gguf_mapping import (ROPE_FREQS, GGUFImportError, hf_architecture, hf_config,
                                  hf_tensor_name, llama3_rope_scaling, read_metadata, unpermute_rows)
from backend.gguf_tokenizer import build_tokenizer, tokenizer_config

__all__ = ["GGUFImportError", "import_gguf", "main"]

OUTPUT_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # -> bytes per value
SHARD_BYTES = 2 << 30


def _numpy_shape(tensor) -> tuple[int, ...]:
    return tuple(reversed([int(s) for s in tensor.shape]))  # GGUF lists dimensions innermost first


def _dequantized(tensor) -> np.ndarray:
    try:
        return dequantize(tensor.data, int(tensor.tensor_type), _numpy_shape(tensor))
    except ValueError as exc:
        raise GGUFImportError(f"tensor {tensor.name}: {exc}") from None


def _hf_tensor(tensor, config: dict[str, Any], permuted: bool) -> tuple[str, np.ndarray]:
    name, array = hf_tensor_name(tensor.name), _dequantized(tensor)
    if permuted and ".q_proj." in name:
        array = unpermute_rows(array, config["num_attention_heads"])
    elif permuted and ".k_proj." in name:
        array = unpermute_rows(array, config["num_key_value_heads"])
    return name, array


def _shards(tensors: list, itemsize: int) -> list[list]:
    """Tensors grouped in file order into shards of at most SHARD_BYTES (a bigger one alone)."""
    shards: list[list] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = int(np.prod(_numpy_shape(tensor))) * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def _save(arrays: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)).to(torch_dtype) for k, v in arrays.items()},
              str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates the file owner-only; a server user must read it


def write_weights(reader, config: dict[str, Any], arch: str, folder: Path, dtype: str) -> None:
    """Dequantize every tensor into ``folder`` under its HF name, one shard at a time."""
    weights = [t for t in reader.tensors if t.name != ROPE_FREQS]
    if not any(t.name == "token_embd.weight" for t in weights):
        raise GGUFImportError("the GGUF file has no token_embd.weight")
    permuted = arch in ("llama", "mistral")  # Qwen2 files keep HF's row order
    shards = _shards(weights, OUTPUT_DTYPES[dtype])
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, 1):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{index:05d}-of-{len(shards):05d}.safetensors")
        arrays = dict(_hf_tensor(t, config, permuted) for t in shard)
        _save(arrays, folder / file, dtype)
        weight_map.update(dict.fromkeys(arrays, file))
    if len(shards) > 1:
        total = sum(int(np.prod(_numpy_shape(t))) for t in weights) * OUTPUT_DTYPES[dtype]
        _write_json(folder / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32",
                force: bool = False, log=print) -> Path:
    """Convert ``gguf_path`` into the checkpoint folder ``out_dir`` and return it.

    The folder is written beside ``out_dir`` and renamed into place at the end, so ``out_dir``
    exists only once it is complete. An existing non-empty ``out_dir`` is replaced only with
    ``force``.
    """
    from gguf import GGUFReader

    if dtype not in OUTPUT_DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass --force to replace it)")
    start = time.monotonic()
    reader = GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    arch, _ = hf_architecture(meta)
    types = sorted({type_name(t.tensor_type) for t in reader.tensors})
    unreadable = sorted({type_name(t.tensor_type) for t in reader.tensors
                         if int(t.tensor_type) not in TYPE_NAMES})
    if unreadable:  # before any work: a Q6_K file fails at once, naming the types
        raise GGUFImportError(f"GGUF tensor type(s) {', '.join(unreadable)} not supported; "
                              f"supported: {', '.join(supported_types())}")
    log(f"import-gguf: {gguf_path.name}: {arch}, {len(reader.tensors)} tensors ({', '.join(types)})")
    config = hf_config(meta, {t.name: _numpy_shape(t) for t in reader.tensors}, dtype)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:  # derived data, kept as config parameters
            config["rope_scaling"] = llama3_rope_scaling(_dequantized(tensor).astype(np.float64), config)
        else:
            hf_tensor_name(tensor.name)  # refuse unknown tensors before writing anything

    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write_weights(reader, config, arch, staging, dtype)
        _write_json(staging / "config.json", config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if k in config}
        _write_json(staging / "generation_config.json", generation)
        try:
            build_tokenizer(meta).save(str(staging / "tokenizer.json"))
            _write_json(staging / "tokenizer_config.json", tokenizer_config(meta))
        except ValueError as exc:  # weights still serve requests sent as input_ids
            log(f"import-gguf: no tokenizer written: {exc}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"import-gguf: wrote {out_dir} ({dtype}) in {time.monotonic() - start:.1f} s")
    return out_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="inflight import-gguf",
        description="Convert a GGUF file (Llama, Mistral, Qwen2) into a Hugging Face checkpoint folder.")
    parser.add_argument("file", help="the .gguf file")
    parser.add_argument("--out", required=True, help="the checkpoint folder to write")
    parser.add_argument("--dtype", default="float32", choices=OUTPUT_DTYPES,
                        help="weights' dtype in the folder (default float32: the dequantized values exactly)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    try:
        import_gguf(args.file, args.out, dtype=args.dtype, force=args.force)
    except (GGUFImportError, FileNotFoundError, FileExistsError) as exc:
        print(f"inflight import-gguf: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
