"""``inflight import-gguf FILE.gguf --out DIR``: a GGUF file (llama.cpp, Ollama) to a Hugging Face
checkpoint folder that the engine loads.

The folder gets ``config.json`` (with ``architectures``), the weights under HF names
(``model.safetensors``, or 2 GiB shards with ``model.safetensors.index.json`` for large models),
``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template) and
``generation_config.json``. Quantized tensors stay packed, in the layout of docs/quantization.md
(backend/models/gguf/packed.py); ``--dequantize`` writes float weights instead (kernels/quant_reference.py
dequantizes, to ggml's values exactly). Only the ``gguf`` reader, numpy, safetensors, tokenizers
and torch (to write) are used: nothing downloaded, nothing executed from the file.

Nothing in the file is trusted before backend/models/gguf/checks.py has checked it: a hostile or broken
file ends in one line naming what is wrong (exit status 2), never a traceback or a huge allocation.
The meaning of names and keys is backend/models/gguf/mapping.py. The file is memory-mapped and converted
one shard at a time. tests/test_gguf_import.py checks the result against transformers' GGUF loader.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from backend.models.checkpoint_config import CheckpointConfigError
from backend.models.gguf.checks import check_config, check_shapes, scan
from backend.models.gguf import mmproj as mm
from backend.models.gguf.mapping import (ROPE_FREQS, GGUFImportError, hf_architecture, hf_config, hf_tensor_name,
                                         llama3_rope_scaling, read_metadata)
from backend.models.gguf.packed import TYPE_NAMES, float_array, supported_types, type_name
from backend.models.gguf.tensors import (OUTPUT_DTYPES, float_file_dtype, numpy_shape, save_safetensors, to_torch,
                                         write_json, write_weights)
from backend.models.gguf.tokenizer import build_tokenizer, tokenizer_config

__all__ = ["GGUFImportError", "import_gguf", "main", "LAYOUT"]

LAYOUT = "inflight-gguf-packed/1"  # docs/quantization.md; the loader refuses other layouts


def _open(gguf_path: Path):
    """The checked file's reader and metadata (backend/models/gguf/checks.py first, then gguf's reader)."""
    from gguf import GGUFReader

    infos = scan(gguf_path)
    unreadable = sorted({type_name(t.ggml_type) for t in infos if t.ggml_type not in TYPE_NAMES})
    if unreadable:  # before any work: a Q2_K file fails at once, naming the types
        raise GGUFImportError(f"GGUF tensor type(s) {', '.join(unreadable)} not supported; "
                              f"supported: {', '.join(supported_types())}")
    try:
        reader = GGUFReader(str(gguf_path))
        return reader, read_metadata(reader)
    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:  # what survives the scan
        raise GGUFImportError(f"{gguf_path.name}: unreadable GGUF metadata: {exc}") from None


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32",
                dequantize: bool = False, force: bool = False, log=print,
                mmproj: Optional[str | Path] = None) -> Path:
    """Convert ``gguf_path`` into the checkpoint folder ``out_dir`` and return it.

    ``mmproj``: llama.cpp's vision file of the same model (backend/models/gguf/mmproj.py): the
    folder is then a Gemma3ForConditionalGeneration or a Qwen2_5_VLForConditionalGeneration
    (mmproj_qwen.py) with its vision tower.

    Quantized tensors stay packed unless ``dequantize`` (then every weight is written in ``dtype``).
    The folder is written beside ``out_dir`` and renamed into place at the end, so ``out_dir``
    exists only once it is complete. An existing non-empty ``out_dir`` is replaced only with
    ``force``.
    """
    if dtype not in OUTPUT_DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(OUTPUT_DTYPES)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    for path in (gguf_path, *([Path(mmproj)] if mmproj is not None else [])):
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass --force to replace it)")
    start = time.monotonic()
    reader, meta = _open(gguf_path)
    arch, _ = hf_architecture(meta)
    shapes = {t.name: numpy_shape(t) for t in reader.tensors}
    types = sorted({type_name(t.tensor_type) for t in reader.tensors})
    log(f"import-gguf: {gguf_path.name}: {arch}, {len(reader.tensors)} tensors ({', '.join(types)})")
    config = hf_config(meta, shapes, dtype if dequantize else "bfloat16")
    check_config(config, arch, head_dim_given=meta.get(f"{arch}.attention.key_length") is not None)
    check_shapes({n: s for n, s in shapes.items() if n != ROPE_FREQS}, config, arch)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:  # derived data, kept as config parameters
            factors = to_torch(float_array(tensor.data, int(tensor.tensor_type), numpy_shape(tensor)),
                             int(tensor.tensor_type), "float32").numpy()
            config["rope_scaling"] = llama3_rope_scaling(factors.astype(np.float64), config)
        else:
            hf_tensor_name(tensor.name, arch)  # refuse unknown tensors before writing anything
    vision = None
    if mmproj is not None:  # checked whole before anything is written
        vision_reader, vision_meta = _open(Path(mmproj))
        vision = mm.read_mmproj(vision_meta, {t.name: numpy_shape(t) for t in vision_reader.tensors},
                                Path(mmproj).name, arch, meta, config)
        log(f"import-gguf: {Path(mmproj).name}: {vision.summary}, {len(vision_reader.tensors)} tensors")

    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        modules = write_weights(reader, config, arch, staging, dtype if dequantize else None)
        if modules:
            config["quantization_config"] = {"quant_method": "gguf", "layout": LAYOUT, "group_size": 32,
                                             "source": gguf_path.name, "modules": modules}
        elif not dequantize:  # a float file: its matrices' own dtype, which dtype=auto keeps
            config.update(float_file_dtype(reader.tensors))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if k in config}
        if vision is not None:
            vision.write(staging, vision_reader, save_safetensors)
            config = vision.config(config)
        write_json(staging / "config.json", config)
        write_json(staging / "generation_config.json", generation)
        try:
            build_tokenizer(meta).save(str(staging / "tokenizer.json"))
            write_json(staging / "tokenizer_config.json", tokenizer_config(meta))
        except ValueError as exc:  # weights still serve requests sent as input_ids
            log(f"import-gguf: no tokenizer written: {exc}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    kept = f"{dtype}, dequantized" if dequantize else (
        f"{len(modules)} matrices packed" if modules else "float, nothing quantized")
    log(f"import-gguf: wrote {out_dir} ({kept}) in {time.monotonic() - start:.1f} s")
    return out_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="inflight import-gguf",
        description="Convert a GGUF file (Llama, Mistral, Qwen2, Qwen2.5-VL, Qwen3, Gemma 3, Mixtral, Qwen3-MoE) into a "
                    "Hugging Face checkpoint folder, "
                    "its quantized weights kept packed (docs/quantization.md).")
    parser.add_argument("file", help="the .gguf file")
    parser.add_argument("--out", required=True, help="the checkpoint folder to write")
    parser.add_argument("--dequantize", action="store_true",
                        help="write float weights instead of packed ones (--dtype)")
    parser.add_argument("--dtype", default=None, choices=OUTPUT_DTYPES,
                        help="with --dequantize: the weights' dtype (default float32: the values exactly)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--mmproj", metavar="MMPROJ.gguf",
                        help="llama.cpp's vision file of the same model (Gemma 3's or Qwen2.5-VL's mmproj-*.gguf): the folder "
                             "then serves images (docs/vision.md)")
    args = parser.parse_args(argv)
    if args.dtype and not args.dequantize:
        print("inflight import-gguf: --dtype applies to --dequantize (a packed import keeps every "
              "tensor's own type)", file=sys.stderr)
        return 2
    try:
        import_gguf(args.file, args.out, dtype=args.dtype or "float32", dequantize=args.dequantize,
                    force=args.force, mmproj=args.mmproj)
    except (CheckpointConfigError, FileNotFoundError, FileExistsError) as exc:  # GGUFImportError is one
        print(f"inflight import-gguf: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
