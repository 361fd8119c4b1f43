"""A tiny Gemma 3 vision checkpoint as llama.cpp's convert_hf_to_gguf.py splits it (test-only): the
text model's GGUF (tests/gguf_files.py's write_gguf_from_hf on the language model's tensors, the
vocabulary padded to the embedding's rows with [PADn] tokens as the converter pads it) and the
``mmproj`` file of the vision tower and the projector, named by gguf-py's own tensor map for
MODEL_ARCH.MMPROJ, with Gemma3VisionModel's keys and types (the patch and position embeddings F32,
the input projection F16 whatever the file type, other matrices the file type, vectors F32) and its
one change of values (mm_soft_emb_norm stored as 1 + w)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from gguf_files import finish, write_gguf_from_hf
from vision_checkpoint import make_vision_checkpoint

# What llama.cpp's gemma3 takes as given (tests/test_gguf_qwen3_gemma3.py): a global layer after five
# local ones, the attention scale 1/sqrt(head_dim).
GEMMA3_AS_LLAMA_CPP = dict(num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=32)


def f16_exact_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """The vision checkpoint (with its tokenizer: the image markers are ids 2000-2002) whose text
    model llama.cpp's gemma3 can express and whose every weight is a float16 value, so that the
    converter's F16 tensors hold it exactly."""
    from safetensors.torch import load_file, save_file
    path = make_vision_checkpoint(out_dir, seed=seed, tokenizer=True, **GEMMA3_AS_LLAMA_CPP)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v.half().to(v.dtype).contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _padded_tokenizer(tokenizer_json: Path, vocab_size: int, out: Path) -> Path:
    """tokenizer.json with its added tokens in the vocabulary and [PADn] up to `vocab_size`, as the
    converter lists the tokens of a model whose embedding has more rows than its tokenizer ids."""
    data = json.loads(Path(tokenizer_json).read_text())
    vocab = dict(data["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    taken = set(vocab.values())
    vocab.update({f"[PAD{i}]": i for i in range(vocab_size) if i not in taken})
    data["model"]["vocab"] = vocab
    out.write_text(json.dumps(data))
    return out


def write_text_gguf(path: Path, hf_dir: Path, types: Sequence[str] = ("F16",)) -> None:
    """The language model of a Gemma3ForConditionalGeneration checkpoint as the converter writes it
    (its prefix off: the text tensors of a Gemma3ForCausalLM)."""
    from safetensors.numpy import load_file, save_file
    config = json.loads((hf_dir / "config.json").read_text())
    text = {**config["text_config"], "architectures": ["Gemma3ForCausalLM"]}
    work = path.parent / f"{path.stem}-text-hf"
    work.mkdir(exist_ok=True)
    (work / "config.json").write_text(json.dumps(text))
    weights = {}
    for name, value in load_file(str(hf_dir / "model.safetensors")).items():
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                weights["model." + name[len(prefix):]] = value
    save_file(weights, str(work / "model.safetensors"))
    tokenizer = _padded_tokenizer(hf_dir / "tokenizer.json", text["vocab_size"], work / "tokenizer.json")
    write_gguf_from_hf(path, work, tokenizer, types)


def hub_vision_name(name: str) -> Optional[str]:
    """A checkpoint tensor's name as the converter sees the Hub's Gemma 3 (vision_tower.vision_model.*,
    multi_modal_projector.*); None for the text model's."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None


def write_mmproj(path: Path, hf_dir: Path, ftype: str = "F16", projector: str = "gemma3", skip: Sequence[str] = (),
                 replace: Optional[dict] = None, keys: Optional[dict] = None) -> dict[str, np.ndarray]:
    """The vision tower and projector of `hf_dir` as the converter's mmproj file. `skip`: GGUF tensors
    left out; `replace`: GGUF name -> array written instead; `keys`: metadata keys set to other values.
    Returns the written arrays by GGUF name (before any replacement)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import load_file
    config = json.loads((hf_dir / "config.json").read_text())
    vision, hidden = config["vision_config"], config["text_config"]["hidden_size"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(1 if ftype == "F16" else 0)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(hidden)
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean([0.5, 0.5, 0.5])   # Gemma 3's preprocessor_config.json
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_clip_projector_type(projector)
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    writer.add_vision_use_gelu(True)
    scale = (vision["image_size"] // vision["patch_size"]) // int(config["mm_tokens_per_image"] ** 0.5)
    if scale != 4:
        writer.add_vision_projector_scale_factor(scale)
    for key, value in (keys or {}).items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    written = {}
    for hf, value in load_file(str(hf_dir / "model.safetensors")).items():
        name = hub_vision_name(hf)
        if name is None or "vision_model.head." in name:
            continue
        name = name.replace("_weight", ".weight")
        value = value.astype(np.float32)
        if "soft_emb_norm.weight" in name:
            value = value + 1
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        written[new] = value
        if new in skip:
            continue
        value = (replace or {}).get(new, value)
        qtype = (T.F16 if "input_projection" in name else T.F32 if ".embeddings." in name or value.ndim <= 1
                 else T[ftype])
        writer.add_tensor(new, value.astype(np.float16 if qtype == T.F16 else np.float32))
    finish(writer)
    return written
