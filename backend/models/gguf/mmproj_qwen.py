"""Qwen2.5-VL's mmproj file (``clip.projector_type`` "qwen2.5vl_merger") with its text file
(``general.architecture`` "qwen2vl") to one Qwen2_5_VLForConditionalGeneration folder
(backend/models/qwen2_5_vl_vision.py loads it; docs/vision.md, "GGUF").

llama.cpp's converter (convert_hf_to_gguf.py's Qwen2VLVisionModel) writes:

- keys: ``clip.has_vision_encoder``; ``clip.vision.embedding_length`` (the tower's width),
  ``feed_forward_length``, ``block_count`` (HF's depth), ``attention.head_count``, ``patch_size``,
  ``image_size`` (560 unless the config says: unused, the tower takes any size),
  ``projection_dim`` (the text model's hidden size), ``image_mean`` / ``image_std``,
  ``attention.layer_norm_epsilon``; ``clip.use_silu`` (the MLP's activation); ``clip.vision.n_wa_pattern``:
  the full-attention blocks are every n-th (HF's ``fullatt_block_indexes`` [n-1, 2n-1, ...]), the
  others attend within windows. The window (112 pixels) and the merge (2 x 2) are clip.cpp's
  constants; ``clip.vision.window_size`` / ``spatial_merge_size`` / ``image_min_pixels`` /
  ``image_max_pixels`` are read where a file has them.
- tensors: the Conv3d patch embedding [d, 3, 2, p, p] cut into its two temporal halves
  ``v.patch_embd.weight`` and ``v.patch_embd.weight.1`` (each [d, 3, p, p]); per block the fused
  qkv cut into ``attn_q`` / ``attn_k`` / ``attn_v`` (weight and bias), ``attn_out``, the RMSNorms
  ``ln1`` / ``ln2`` (weight only), ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` (with biases); the
  merger's RMSNorm ``v.post_ln.weight`` and its two linears ``mm.0`` [4d, 4d], ``mm.2`` [text, 4d].
  Here they are put back together under transformers' names (``model.visual.*``), in float32.

The text file's ``qwen2vl.rope.dimension_sections`` (four counts, llama.cpp's M-RoPE sections; the
fourth 0) are the text config's ``mrope_section``; the image markers come from its vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from backend.models.checkpoint_config import Reader
from backend.models.gguf.mapping import GGUFImportError
from backend.models.gguf.mmproj_tensors import add_to_index, check_shapes_against, float32_tensor, three

PROJECTOR = "qwen2.5vl_merger"
TEXT_ARCH = "qwen2vl"
WINDOW_SIZE, MERGE = 112, 2  # clip.cpp's constants for qwen2.5vl (HF's window_size, spatial_merge_size)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2VLImageProcessor's defaults
VISUAL = "model.visual."
MARKERS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
           "image_token_id": "<|image_pad|>"}
_BLOCK = {"attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_QKV = ("attn_q", "attn_k", "attn_v")


@dataclass(frozen=True)
class QwenMmproj:
    """What a Qwen2.5-VL mmproj file adds to the text model's folder, every value checked."""
    name: str
    vision_config: dict[str, Any]
    mrope_section: list[int]
    token_ids: dict[str, int]
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    min_pixels: int
    max_pixels: int

    @property
    def summary(self) -> str:
        v = self.vision_config
        return (f"Qwen2.5-VL vision tower, {v['depth']} blocks (full attention at {v['fullatt_block_indexes']}), "
                f"{v['patch_size'] * v['spatial_merge_size']} pixels a token")

    def config(self, text_config: dict[str, Any]) -> dict[str, Any]:
        return multimodal_config(text_config, self)

    def write(self, folder: Path, reader, save) -> None:
        write_vision(folder, reader, self, save)


def read(r: Reader, shapes: Mapping[str, tuple[int, ...]], name: str, text_arch: str,
         text_meta: Mapping[str, Any], text_config: Mapping[str, Any]) -> QwenMmproj:
    """The checked settings (`r` reads the mmproj's keys)."""
    if text_arch != TEXT_ARCH:
        raise GGUFImportError(f"{name}: a {PROJECTOR} projector goes with a {TEXT_ARCH} text model; the text "
                              f"file's general.architecture is {text_arch!r}")
    if r.flag("clip.has_vision_encoder", False) is not True:
        r.fail("clip.has_vision_encoder", r.cfg.get("clip.has_vision_encoder"), "true (a vision tower)")
    d = r.integer("clip.vision.embedding_length", high=1 << 16)
    heads = r.integer("clip.vision.attention.head_count", high=d)
    if d % heads or (d // heads) % 4:
        raise GGUFImportError(f"{name}: clip.vision.embedding_length {d} over clip.vision.attention.head_count "
                              f"{heads} must give a head size that is a multiple of 4 (2-D rotary)")
    depth = r.integer("clip.vision.block_count", high=1024)
    patch = r.integer("clip.vision.patch_size", high=1024)
    r.integer("clip.vision.image_size", 560, high=1 << 16)
    merge = r.integer("clip.vision.spatial_merge_size", MERGE, high=16)
    window = r.integer("clip.vision.window_size", WINDOW_SIZE, high=1 << 16)
    if window % (patch * merge):
        raise GGUFImportError(f"{name}: clip.vision.window_size {window} is not a multiple of patch_size x "
                              f"spatial_merge_size = {patch * merge}")
    pattern = r.integer("clip.vision.n_wa_pattern", high=depth)  # required: clip.cpp's too
    hidden = text_config["hidden_size"]
    if r.integer("clip.vision.projection_dim") != hidden:
        raise GGUFImportError(f"{name}: clip.vision.projection_dim is {r.cfg['clip.vision.projection_dim']}; the "
                              f"text model's hidden size ({text_arch}.embedding_length) is {hidden}")
    if r.flag("clip.use_silu", False):
        act = "silu"
    elif r.flag("clip.use_gelu", False):
        act = "gelu"
    else:
        r.fail("clip.use_silu", r.cfg.get("clip.use_silu"), "true (Qwen2.5-VL's MLP is gated by SiLU)")
    r.number("clip.vision.attention.layer_norm_epsilon", 1e-6, high=1.0)  # (the tower's RMSNorms: 1e-6, as HF's)
    low = r.integer("clip.vision.image_min_pixels", MIN_PIXELS, high=1 << 31)
    high = r.integer("clip.vision.image_max_pixels", max(MAX_PIXELS, low), low=low, high=1 << 31)
    mean, std = three(r, "clip.vision.image_mean", 0.5), three(r, "clip.vision.image_std", 0.5)
    if min(std) <= 0:
        r.fail("clip.vision.image_std", list(std), "three positive numbers")
    vision = {"model_type": "qwen2_5_vl_vision", "depth": depth, "hidden_size": d,
              "intermediate_size": r.integer("clip.vision.feed_forward_length", high=1 << 18),
              "num_heads": heads, "patch_size": patch, "temporal_patch_size": 2, "spatial_merge_size": merge,
              "window_size": window, "fullatt_block_indexes": [i for i in range(depth) if (i + 1) % pattern == 0],
              "out_hidden_size": hidden, "hidden_act": act, "in_channels": 3}
    check_shapes(shapes, vision, name)
    return QwenMmproj(name, vision, mrope_section(text_meta, text_config), token_ids(text_meta),
                      mean, std, low, high)


def mrope_section(text_meta: Mapping[str, Any], text_config: Mapping[str, Any]) -> list[int]:
    """The text file's rope sections as HF's mrope_section (time, height, width)."""
    key = f"{TEXT_ARCH}.rope.dimension_sections"
    value = text_meta.get(key)
    half = text_config["head_dim"] // 2
    if not (isinstance(value, list) and len(value) == 4 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in value)
            and value[3] == 0 and sum(value) == half):
        raise GGUFImportError(f"the text file's {key} is {value!r}; it must be four counts (time, height, width, 0) "
                              f"of rotary frequencies summing to head_dim / 2 = {half}")
    return [int(v) for v in value[:3]]


def token_ids(text_meta: Mapping[str, Any]) -> dict[str, int]:
    tokens = text_meta.get("tokenizer.ggml.tokens") or []
    where = {t: i for i, t in enumerate(tokens) if t in MARKERS.values()}
    missing = [t for t in MARKERS.values() if t not in where]
    if missing:
        raise GGUFImportError(f"the text file's vocabulary (tokenizer.ggml.tokens) has no {missing[0]} token: "
                              "Qwen2.5-VL's image markers are needed to place images in a prompt")
    return {key: where[token] for key, token in MARKERS.items()}


def expected_shapes(vision: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen2.5-VL mmproj file with these settings, by GGUF name, numpy shape."""
    d, ffn, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged, out = d * vision["spatial_merge_size"] ** 2, vision["out_hidden_size"]
    shapes = {"v.patch_embd.weight": (d, 3, p, p), "v.patch_embd.weight.1": (d, 3, p, p), "v.post_ln.weight": (d,),
              "mm.0.weight": (merged, merged), "mm.0.bias": (merged,), "mm.2.weight": (out, merged), "mm.2.bias": (out,)}
    for i in range(vision["depth"]):
        b = f"v.blk.{i}."
        for part in (*_QKV, "attn_out"):
            shapes.update({b + part + ".weight": (d, d), b + part + ".bias": (d,)})
        shapes.update({b + "ln1.weight": (d,), b + "ln2.weight": (d,)})
        for part in ("ffn_gate", "ffn_up"):
            shapes.update({b + part + ".weight": (ffn, d), b + part + ".bias": (ffn,)})
        shapes.update({b + "ffn_down.weight": (d, ffn), b + "ffn_down.bias": (d,)})
    return shapes


def check_shapes(shapes: Mapping[str, tuple[int, ...]], vision: Mapping[str, Any], name: str) -> None:
    check_shapes_against(shapes, expected_shapes(vision), name, "has no counterpart in Qwen2.5-VL's vision tower "
                         f"(clip.vision.block_count {vision['depth']})")


def hf_tensors(tensors: Mapping[str, Any], depth: int) -> dict[str, Any]:
    """The mmproj's float32 tensors (GGUF name -> torch) under transformers' names: the patch
    embedding's halves stacked back over time, each block's q, k, v fused back into qkv."""
    import torch
    out = {VISUAL + "patch_embed.proj.weight": torch.stack([tensors["v.patch_embd.weight"],
                                                             tensors["v.patch_embd.weight.1"]], dim=2),
           VISUAL + "merger.ln_q.weight": tensors["v.post_ln.weight"]}
    for i in (0, 2):
        for suffix in ("weight", "bias"):
            out[f"{VISUAL}merger.mlp.{i}.{suffix}"] = tensors[f"mm.{i}.{suffix}"]
    for b in range(depth):
        blk, hf = f"v.blk.{b}.", f"{VISUAL}blocks.{b}."
        for suffix in ("weight", "bias"):
            out[f"{hf}attn.qkv.{suffix}"] = torch.cat([tensors[f"{blk}{p}.{suffix}"] for p in _QKV])
        for part, name in _BLOCK.items():
            for suffix in ("weight",) if part.startswith("ln") else ("weight", "bias"):
                out[f"{hf}{name}.{suffix}"] = tensors[f"{blk}{part}.{suffix}"]
    return {k: v.contiguous() for k, v in out.items()}


def multimodal_config(text_config: dict[str, Any], mm: QwenMmproj) -> dict[str, Any]:
    """config.json: transformers 5's Qwen2_5_VLConfig, the text model's keys in text_config, its rope
    as rope_parameters with the M-RoPE sections."""
    if text_config.get("rope_scaling"):
        raise GGUFImportError(f"the text file's rope scaling {text_config['rope_scaling']} is not supported "
                              "with M-RoPE (Qwen2.5-VL)")
    text = {k: v for k, v in text_config.items()
            if k not in ("architectures", "quantization_config", "rope_theta", "rope_scaling")}
    text.update(model_type="qwen2_5_vl_text", rope_parameters={
        "rope_type": "default", "rope_theta": text_config["rope_theta"], "mrope_section": mm.mrope_section})
    top = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "text_config": text,
           "vision_config": mm.vision_config, **mm.token_ids,
           "tie_word_embeddings": text["tie_word_embeddings"], "torch_dtype": text.get("torch_dtype")}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config"):
        if key in text_config:
            top[key] = text_config[key]
    return top


def write_vision(folder: Path, reader, mm: QwenMmproj, save) -> None:
    """The tower's and the merger's weights (mmproj.safetensors, listed in the index when the text
    weights are sharded) and preprocessor_config.json (backend/engine/qwen2_5_vl_images.py reads it)."""
    tensors = hf_tensors({t.name: float32_tensor(t) for t in reader.tensors}, mm.vision_config["depth"])
    save(tensors, folder / "mmproj.safetensors")
    add_to_index(folder, tensors)
    v = mm.vision_config
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
                 "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mm.image_mean),
                 "image_std": list(mm.image_std), "min_pixels": mm.min_pixels, "max_pixels": mm.max_pixels,
                 "size": {"shortest_edge": mm.min_pixels, "longest_edge": mm.max_pixels},
                 "patch_size": v["patch_size"], "merge_size": v["spatial_merge_size"],
                 "temporal_patch_size": v["temporal_patch_size"]}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n", encoding="utf-8")
