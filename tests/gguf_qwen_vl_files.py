"""A tiny Qwen2.5-VL checkpoint as llama.cpp's convert_hf_to_gguf.py splits it (test-only): the text
model's GGUF (arch ``qwen2vl``: Qwen2's keys and tensor names plus ``qwen2vl.rope.dimension_sections``,
the M-RoPE sections padded to four) and the ``mmproj`` file of Qwen2VLVisionModel: the fused qkv cut
into q, k, v, the Conv3d patch embedding cut into its two temporal halves (``v.patch_embd.weight``,
``.weight.1``), the other names from gguf-py's own tensor map, ``clip.use_silu`` and
``clip.vision.n_wa_pattern`` (fullatt_block_indexes[0] + 1). The checkpoint is transformers' own,
random, every weight a float16 value (the F16 files hold it exactly), on clip.cpp's fixed geometry:
14-pixel patches merged 2 x 2, windows of 112 pixels (4 x 4 merged patches), block 1 of 3 attending
over the whole image."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from gguf_files import add_bpe_tokenizer, add_shape, finish, quantize, tokenizer_metadata
from gguf_vision_files import _padded_tokenizer

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2VLImageProcessor's defaults
_TEXT = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def make_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """The tiny Qwen2_5_VLForConditionalGeneration (tests/qwen2_5_vl.py's text model and tokenizer:
    image markers 2000-2002) on clip.cpp's geometry, its weights rounded to float16 values."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from qwen2_5_vl import _write_tokenizer
    torch.manual_seed(seed)
    text = dict(vocab_size=2048, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1], out_hidden_size=64)
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, vision_start_token_id=2000,
                                 vision_end_token_id=2001, image_token_id=2002, video_token_id=2003)
    model = tf.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    weights = load_file(str(out_dir / "model.safetensors"))
    save_file({k: v.half().to(v.dtype).contiguous() for k, v in weights.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out_dir)
    _write_tokenizer(Path(out_dir))
    return Path(out_dir)


def _weights(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}


def write_text_gguf(path: Path, hf_dir: Path, types: Sequence[str] = ("F16",),
                    sections: Optional[list[int]] = None) -> None:
    """The language model as the converter's Qwen2VLModel writes it (`sections`: other rope sections)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    config = json.loads((hf_dir / "config.json").read_text())
    t = config["text_config"]
    writer = gguf.GGUFWriter(str(path), "qwen2vl")
    add_shape(writer, t["num_hidden_layers"], t["max_position_embeddings"], t["hidden_size"], t["intermediate_size"],
              t["num_attention_heads"], t["num_key_value_heads"], t["rms_norm_eps"])
    writer.add_rope_freq_base(t["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_sections(sections or t["rope_parameters"]["mrope_section"] + [0])
    tokenizer = _padded_tokenizer(hf_dir / "tokenizer.json", t["vocab_size"], path.parent / f"{path.stem}-tok.json")
    add_bpe_tokenizer(writer, *tokenizer_metadata(tokenizer), "smollm")
    matrices = 0
    for hf, w in _weights(hf_dir).items():
        if hf == "lm_head.weight":
            name = "output.weight"
        elif hf.startswith(("model.language_model.", "model.")) and ".visual." not in "." + hf:
            base, suffix = hf.removeprefix("model.").removeprefix("language_model.").rsplit(".", 1)
            if base.startswith("layers."):
                _, layer, part = base.split(".", 2)
                name = f"blk.{layer}.{_TEXT[part]}.{suffix}"
            else:
                name = f"{_TEXT[base]}.{suffix}"
        else:
            continue
        qtype = T.F32
        if w.ndim == 2:
            qtype = T[types[matrices % len(types)]]
            matrices += 1
        writer.add_tensor(name, w if qtype == T.F32 else quantize(w, qtype.name),
                          raw_dtype=None if qtype == T.F32 else qtype)
    finish(writer)


def write_mmproj(path: Path, hf_dir: Path, ftype: str = "F16", skip: Sequence[str] = (),
                 replace: Optional[dict] = None, keys: Optional[dict] = None,
                 drop: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The vision tower and merger as Qwen2VLVisionModel's mmproj file. `skip`: GGUF tensors left out;
    `replace`: GGUF name -> array written instead; `keys`: metadata set to other values; `drop`:
    keys not written. Returns the arrays by GGUF name (before any replacement)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    config = json.loads((hf_dir / "config.json").read_text())
    v, hidden = config["vision_config"], config["text_config"]["hidden_size"]
    processor = json.loads((hf_dir / "preprocessor_config.json").read_text())
    values = {"clip.has_vision_encoder": True, "clip.vision.projection_dim": hidden,
              "clip.vision.image_size": 560, "clip.vision.patch_size": v["patch_size"],
              "clip.vision.embedding_length": v["hidden_size"], "clip.vision.feed_forward_length": v["intermediate_size"],
              "clip.vision.block_count": v["depth"], "clip.vision.attention.head_count": v["num_heads"],
              "clip.vision.image_mean": processor["image_mean"], "clip.vision.image_std": processor["image_std"],
              "clip.projector_type": "qwen2.5vl_merger", "clip.use_silu": True,
              "clip.vision.n_wa_pattern": v["fullatt_block_indexes"][0] + 1,
              "clip.vision.attention.layer_norm_epsilon": 1e-6, **(keys or {})}
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(1 if ftype == "F16" else 0)
    for key, value in values.items():
        if key in drop:
            continue
        kind = gguf.GGUFValueType.get_type(value)
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif isinstance(value, int) and not isinstance(value, bool):
            writer.add_uint32(key, value)
        else:
            writer.add_key_value(key, value, kind)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v["depth"])
    written = {}
    for hf, value in _weights(hf_dir).items():
        hf = hf.removeprefix("model.")  # (transformers saves the Hub's names, visual.*)
        if not hf.startswith("visual."):
            continue
        if ".qkv." in hf:
            parts = [(hf.replace("qkv", p), w) for p, w in zip("qkv", np.split(value, 3))]
        elif "patch_embed.proj.weight" in hf:
            parts = [("v.patch_embd.weight", value[:, :, 0]), ("v.patch_embd.weight.1", value[:, :, 1])]
        else:
            parts = [(hf, value)]
        for name, w in parts:
            new = name if name.startswith("v.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert new is not None, name
            written[new] = w
            if new in skip:
                continue
            w = (replace or {}).get(new, w)
            qtype = T.F32 if w.ndim <= 1 else T.F16 if "patch_embd" in new else T[ftype]
            writer.add_tensor(new, np.ascontiguousarray(w).astype(np.float16 if qtype == T.F16 else np.float32))
    finish(writer)
    return written
