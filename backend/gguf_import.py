"""``inflight import-gguf FILE.gguf --out DIR``: a GGUF file (llama.cpp, Ollama) to a Hugging Face
checkpoint folder that the engine loads.

The folder gets ``config.json`` (with ``architectures``), ``model.safetensors`` (the dequantized
weights under HF names), ``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template) and
``generation_config.json``. Only the ``gguf`` reader, numpy, safetensors and tokenizers are used:
no transformers, nothing downloaded, nothing executed from the file.

What the conversion undoes:

- quantization (backend/gguf_dequant.py: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1);
- GGUF's dimension order: a tensor's shape is listed innermost first, so it is reversed;
- llama.cpp's converter permutes the rows of q_proj and k_proj of Llama-architecture models (its
  rope rotates interleaved pairs, HF's rotates the two halves of each head); the permutation is
  inverted here. Qwen2 files are not permuted.

Mistral files say ``general.architecture = llama``; as in transformers, a ``general.name``
containing "mistral" makes them MistralForCausalLM. Other architectures and tensor types are
refused with a message naming them. The result is checked against transformers' own GGUF loader,
tensor for tensor, in tests/test_gguf_import.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from backend.gguf_dequant import TYPE_NAMES, dequantize, supported_types, type_name
from backend.gguf_tokenizer import build_tokenizer, tokenizer_config

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
OUTPUT_DTYPES = ("float32", "float16", "bfloat16")

# GGUF tensor name (after blk.N.) -> HF name (after model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
# Llama 3.1+ files store their rope scaling as per-frequency factors; HF configs as parameters.
ROPE_FREQS = "rope_freqs.weight"
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFImportError(ValueError):
    """A GGUF file this importer cannot convert (the message says what and why)."""


def read_metadata(reader) -> dict[str, Any]:
    """Every key-value field of a ``gguf.GGUFReader`` as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def hf_architecture(meta: dict[str, Any]) -> tuple[str, str]:
    """(GGUF architecture, HF architecture class) of a file; refuses unsupported ones."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    name = str(meta.get("general.name") or "").lower()
    if arch == "qwen2":
        return arch, "Qwen2ForCausalLM"
    if arch == "mistral" or "mistral" in name:
        return arch, "MistralForCausalLM"
    return arch, "LlamaForCausalLM"


def hf_config(meta: dict[str, Any], tensor_names: Sequence[str], out_dtype: str) -> dict[str, Any]:
    """``config.json`` from the file's ``<arch>.*`` keys and which tensors it has."""
    arch, architecture = hf_architecture(meta)

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata key {arch}.{name} is missing")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                       "Qwen2ForCausalLM": "qwen2"}[architecture],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "vocab_size": int(vocab) if vocab else None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": out_dtype,
    }
    if architecture == "Qwen2ForCausalLM":
        config["use_sliding_window"] = False
    elif architecture == "MistralForCausalLM":
        config["sliding_window"] = None  # the file states none; HF's class default would add one
    else:
        config["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_names)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GGUFImportError(f"{arch}.rope.scaling.type {scaling!r} is not supported; supported: "
                              "none, linear (and Llama 3 scaling stored as rope_freqs)")
    for name, key_ in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        if meta.get(f"tokenizer.ggml.{key_}") is not None:
            config[name] = int(meta[f"tokenizer.ggml.{key_}"])
    return config


def hf_tensor_name(name: str) -> str:
    """HF parameter name of a GGUF tensor name; refuses names it does not know."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix == "weight":
        return f"{_GLOBAL_TENSORS[base]}.weight"
    match = _LAYER_RE.match(name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{suffix}"
    raise GGUFImportError(f"GGUF tensor {name!r} has no counterpart in the supported architectures")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation: per head, rows (pair, 2) back to (2, half)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def llama3_factors(head_dim: int, theta: float, factor: float, low: float = 1.0, high: float = 4.0,
                   original: int = 8192) -> np.ndarray:
    """The per-frequency rope divisors that llama.cpp's converter writes for Llama 3 scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def llama3_rope_scaling(factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """The HF ``rope_scaling`` that reproduces a file's ``rope_freqs``: llama3 with Meta's
    defaults (low 1, high 4, original context 8192) and the file's largest factor; anything else
    is refused rather than imported with positions that differ from the original model."""
    factor = float(factors.max())
    expected = llama3_factors(config["head_dim"], config["rope_theta"], factor)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise GGUFImportError(f"{ROPE_FREQS} is not Llama 3 rope scaling (factor {factor:g}, "
                              "low_freq_factor 1, high_freq_factor 4, original context 8192); "
                              "other rope scalings are not supported")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def convert_tensors(reader, config: dict[str, Any], arch: str) -> dict[str, np.ndarray]:
    """HF name -> float32 array for every tensor of the file."""
    permuted = arch in ("llama", "mistral")  # Qwen2 files keep HF's row order
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        shape = tuple(reversed([int(s) for s in tensor.shape]))
        try:
            array = dequantize(tensor.data, int(tensor.tensor_type), shape)
        except ValueError as exc:
            raise GGUFImportError(f"tensor {tensor.name}: {exc}") from None
        if tensor.name == ROPE_FREQS:  # derived data, kept as config parameters
            config["rope_scaling"] = llama3_rope_scaling(array.astype(np.float64), config)
            continue
        name = hf_tensor_name(tensor.name)
        if permuted and ".q_proj." in name:
            array = unpermute_rows(array, config["num_attention_heads"])
        elif permuted and ".k_proj." in name:
            array = unpermute_rows(array, config["num_key_value_heads"])
        out[name] = array
    if "model.embed_tokens.weight" not in out:
        raise GGUFImportError("the GGUF file has no token_embd.weight")
    if config["vocab_size"] is None:
        config["vocab_size"] = int(out["model.embed_tokens.weight"].shape[0])
    return out


def _save_weights(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)).to(torch_dtype)
               for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates the file owner-only; a server user must read it


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
    config = hf_config(meta, [t.name for t in reader.tensors], dtype)
    tensors = convert_tensors(reader, config, arch)

    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _save_weights(tensors, staging / "model.safetensors", dtype)
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
