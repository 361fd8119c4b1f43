"""``inflight import-gguf TEXT.gguf --mmproj MMPROJ.gguf --out DIR``: llama.cpp's split of a vision-language
model, the text model's GGUF and an ``mmproj-*.gguf`` with the vision tower and the projector, to one
Gemma3ForConditionalGeneration folder (docs/vision.md, "GGUF").

An mmproj file says ``general.architecture`` "clip". Qwen2.5-VL's (``clip.projector_type``
"qwen2.5vl_merger") is read by mmproj_qwen.py; shared helpers are in mmproj_tensors.py. For Gemma 3 (``clip.projector_type`` "gemma3"),
llama.cpp's converter (convert_hf_to_gguf.py's Gemma3VisionModel) writes:

- keys: ``clip.has_vision_encoder``; ``clip.vision.image_size``, ``patch_size``,
  ``embedding_length`` (the tower's width), ``feed_forward_length``, ``block_count``,
  ``attention.head_count``, ``attention.layer_norm_epsilon``, ``projection_dim`` (the text model's
  hidden size), ``image_mean`` / ``image_std``; ``clip.vision.projector.scale_factor``, the
  projector's average-pool kernel (patches per side / tokens per side), only when it is not 4;
- tensors (gguf-py's names for SigLIP): ``v.patch_embd`` (the patch convolution [d, 3, p, p], F32),
  ``v.position_embd`` [patches, d] (F32), per layer ``v.blk.N.attn_q/attn_k/attn_v/attn_out``,
  ``ln1``, ``ln2``, ``ffn_up`` (fc1), ``ffn_down`` (fc2), each with a bias; ``v.post_ln``;
  ``mm.input_projection.weight`` [d, text hidden] (F16, HF's own orientation, not transposed: the
  converter stores it as it is and clip.cpp transposes it at run time) and ``mm.soft_emb_norm.weight``,
  stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w, ggml's by w): the 1 is taken off again here.

The image marker tokens come from the text file's vocabulary (``<start_of_image>``,
``<end_of_image>``, ``<image_soft_token>``). Nothing is trusted before it is checked: the header by
checks.py's scan (the importer opens both files alike), then every key here and every tensor's name
and shape against what the keys imply; a wrong file ends in one line naming the key or the tensor.
Vision weights are written in float32 (quantized ones dequantized): the tower runs in float32.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from backend.models.checkpoint_config import CheckpointConfigError, Reader, shown
from backend.models.gguf import mmproj_qwen
from backend.models.gguf.mapping import GEMMA_NORM_SHIFT, GGUFImportError, float32_decimal
from backend.models.gguf.mmproj_tensors import add_to_index, check_shapes_against, float32_tensor, three

SUPPORTED_PROJECTORS = ("gemma3", "qwen2.5vl_merger")  # the second: mmproj_qwen.py
GEMMA3_SCALE_FACTOR = 4  # llama.cpp's default pooling kernel for gemma3 (896 / 14 = 64 patches -> 16)
MAX_IMAGE_SIZE = 8192
VISION = "vision_tower.vision_model."  # the Hub's Gemma 3 names (backend/models/gemma3_vision.py reads them)
PROJECTOR = "multi_modal_projector."
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
          "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
_GLOBAL = {"v.patch_embd": VISION + "embeddings.patch_embedding",
           "v.position_embd": VISION + "embeddings.position_embedding", "v.post_ln": VISION + "post_layernorm"}
_PROJ = {"mm.input_projection.weight": PROJECTOR + "mm_input_projection_weight",
         "mm.soft_emb_norm.weight": PROJECTOR + "mm_soft_emb_norm.weight"}
IMAGE_MARKERS = {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                 "image_token_index": "<image_soft_token>"}
HF_IMAGE_TOKEN = 262_144  # transformers' Gemma 3 image_token_index, when the vocabulary does not name it


@dataclass(frozen=True)
class Mmproj:
    """What an mmproj file adds to the text model's folder, every value checked."""
    name: str  # the file's name, for messages
    vision_config: dict[str, Any]
    mm_tokens_per_image: int
    token_ids: dict[str, int]  # image_token_index, boi_token_index, eoi_token_index
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @property
    def summary(self) -> str:
        return f"gemma3 vision tower, {self.mm_tokens_per_image} tokens per image"

    def config(self, text_config: dict[str, Any]) -> dict[str, Any]:
        return multimodal_config(text_config, self)

    def write(self, folder: Path, reader, save) -> None:
        write_vision(folder, reader, self, save)


def hf_name(name: str) -> str:
    """The HF name of an mmproj tensor; refuses names a Gemma 3 tower and projector do not have."""
    if name in _PROJ:
        return _PROJ[name]
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL and suffix in ("weight", "bias"):
        return f"{_GLOBAL[base]}.{suffix}"
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in _LAYER \
            and parts[4] in ("weight", "bias"):
        return f"{VISION}encoder.layers.{int(parts[2])}.{_LAYER[parts[3]]}.{parts[4]}"
    raise GGUFImportError(f"mmproj tensor {name!r} has no counterpart in Gemma 3's vision tower or projector")


def read_mmproj(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], name: str, text_arch: str,
                text_meta: Mapping[str, Any], text_config: Mapping[str, Any]):
    """The checked vision settings of an mmproj file (`meta` its keys, `shapes` its tensors' numpy
    shapes) for the text model read from `text_meta` / `text_config`; GGUFImportError naming the
    key or the tensor."""
    try:
        return _read(meta, shapes, name, text_arch, text_meta, text_config)
    except CheckpointConfigError as exc:  # (Reader's: the key named, the file's name first)
        raise exc if isinstance(exc, GGUFImportError) else GGUFImportError(str(exc)) from None


def _read(meta, shapes, name: str, text_arch: str, text_meta, text_config) -> Mmproj:
    r = Reader(dict(meta), f"{name}: ")
    if meta.get("general.architecture") != "clip":
        r.fail("general.architecture", meta.get("general.architecture"), "'clip' (an mmproj file)")
    key = "clip.projector_type" if "clip.projector_type" in meta else "clip.vision.projector_type"
    projector = meta.get(key)
    if projector not in SUPPORTED_PROJECTORS:
        raise GGUFImportError(f"{name}: {key} is {shown(projector)}; supported: {', '.join(SUPPORTED_PROJECTORS)}")
    if projector == "qwen2.5vl_merger":
        return mmproj_qwen.read(r, shapes, name, text_arch, text_meta, text_config)
    if text_arch != "gemma3":
        raise GGUFImportError(f"{name}: a gemma3 projector goes with a gemma3 text model; the text file's "
                              f"general.architecture is {text_arch!r}")
    if r.flag("clip.has_vision_encoder", False) is not True:
        r.fail("clip.has_vision_encoder", meta.get("clip.has_vision_encoder"), "true (a vision tower)")
    d = r.integer("clip.vision.embedding_length", high=1 << 16)
    heads = r.integer("clip.vision.attention.head_count", high=d)
    if d % heads:
        raise GGUFImportError(f"{name}: clip.vision.embedding_length {d} is not a multiple of "
                              f"clip.vision.attention.head_count {heads}")
    image_size = r.integer("clip.vision.image_size", high=MAX_IMAGE_SIZE)
    patch = r.integer("clip.vision.patch_size", high=image_size)
    if image_size % patch:
        raise GGUFImportError(f"{name}: clip.vision.patch_size {patch} does not divide clip.vision.image_size {image_size}")
    per_side = image_size // patch
    scale = r.integer("clip.vision.projector.scale_factor", GEMMA3_SCALE_FACTOR, high=per_side)
    if per_side % scale:
        raise GGUFImportError(f"{name}: clip.vision.projector.scale_factor {scale} does not divide the "
                              f"{per_side} patches per side (clip.vision.image_size / patch_size)")
    hidden = text_config["hidden_size"]
    if r.integer("clip.vision.projection_dim") != hidden:
        raise GGUFImportError(f"{name}: clip.vision.projection_dim is {meta['clip.vision.projection_dim']}; the text "
                              f"model's hidden size ({text_arch}.embedding_length) is {hidden}")
    vision = {"model_type": "siglip_vision_model", "hidden_size": d,
              "intermediate_size": r.integer("clip.vision.feed_forward_length", high=1 << 18),
              "num_hidden_layers": r.integer("clip.vision.block_count", high=1024), "num_attention_heads": heads,
              "image_size": image_size, "patch_size": patch, "num_channels": 3, "vision_use_head": False,
              # a float32 key: its shortest decimal, the value the checkpoint had (1e-6, not 9.99999997e-07)
              "layer_norm_eps": float32_decimal(r.number("clip.vision.attention.layer_norm_epsilon", high=1.0)),
              "hidden_act": "gelu_pytorch_tanh"}
    mean, std = (three(r, k, default) for k, default in (("clip.vision.image_mean", 0.5), ("clip.vision.image_std", 0.5)))
    if min(std) <= 0:
        r.fail("clip.vision.image_std", list(std), "three positive numbers")
    check_shapes(shapes, vision, hidden, name)
    return Mmproj(name, vision, (per_side // scale) ** 2, image_token_ids(text_meta, text_config["vocab_size"]),
                  mean, std)


def expected_shapes(vision: Mapping[str, int], text_hidden: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Gemma 3 mmproj file with these settings, by GGUF name, numpy shape."""
    d, ffn, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    patches = (vision["image_size"] // p) ** 2
    shapes = {"v.patch_embd.weight": (d, 3, p, p), "v.patch_embd.bias": (d,), "v.position_embd.weight": (patches, d),
              "v.post_ln.weight": (d,), "v.post_ln.bias": (d,),
              "mm.input_projection.weight": (d, text_hidden), "mm.soft_emb_norm.weight": (d,)}
    for i in range(vision["num_hidden_layers"]):
        b = f"v.blk.{i}."
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes.update({b + part + ".weight": (d, d), b + part + ".bias": (d,)})
        for part in ("ln1", "ln2"):
            shapes.update({b + part + ".weight": (d,), b + part + ".bias": (d,)})
        shapes.update({b + "ffn_up.weight": (ffn, d), b + "ffn_up.bias": (ffn,),
                       b + "ffn_down.weight": (d, ffn), b + "ffn_down.bias": (d,)})
    return shapes


def check_shapes(shapes: Mapping[str, tuple[int, ...]], vision: Mapping[str, int], text_hidden: int, name: str) -> None:
    """Each tensor one the keys imply, with that shape, and none missing."""
    for tensor in shapes:
        hf_name(tensor)  # an unknown name is refused by name first
    check_shapes_against(shapes, expected_shapes(vision, text_hidden), name,
                         f"is beyond clip.vision.block_count {vision['num_hidden_layers']}")


def image_token_ids(text_meta: Mapping[str, Any], vocab_size: int) -> dict[str, int]:
    """The image markers' ids in the text file's vocabulary (Gemma 3's image token, which llama.cpp
    never feeds, may be absent: then transformers' id, when the embedding has that row)."""
    tokens = text_meta.get("tokenizer.ggml.tokens") or []
    where = {t: i for i, t in enumerate(tokens) if t in IMAGE_MARKERS.values()}
    ids = {}
    for key, token in IMAGE_MARKERS.items():
        if token in where:
            ids[key] = where[token]
        elif key == "image_token_index" and HF_IMAGE_TOKEN < vocab_size:
            ids[key] = HF_IMAGE_TOKEN
        else:
            raise GGUFImportError(f"the text file's vocabulary (tokenizer.ggml.tokens) has no {token} token: "
                                  "Gemma 3's image markers are needed to place images in a prompt")
    return ids


def vision_tensors(reader) -> dict[str, Any]:
    """Every mmproj tensor under its HF name, float32 (torch), the projector's norm as HF's w."""
    out = {}
    for tensor in reader.tensors:
        value = float32_tensor(tensor)
        if tensor.name == "mm.soft_emb_norm.weight":  # the converter stored 1 + w
            value = value - GEMMA_NORM_SHIFT
        out[hf_name(tensor.name)] = value.contiguous()
    return out


def multimodal_config(text_config: dict[str, Any], mm: Mmproj) -> dict[str, Any]:
    """config.json of the folder: the text model's configuration as Gemma3ForConditionalGeneration's
    text_config, beside the vision tower's."""
    text = {k: v for k, v in text_config.items() if k not in ("architectures", "quantization_config")}
    top = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
           "vision_config": mm.vision_config, "mm_tokens_per_image": mm.mm_tokens_per_image, **mm.token_ids,
           "tie_word_embeddings": text["tie_word_embeddings"], "torch_dtype": text.get("torch_dtype")}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "quantization_config"):
        if key in text_config:
            top[key] = text_config[key]
    return top


def write_vision(folder: Path, reader, mm: Mmproj, save) -> None:
    """The tower's and the projector's weights (their own file, listed in the index when the text
    weights are sharded) and preprocessor_config.json (what the image front reads)."""
    tensors = vision_tensors(reader)
    save(tensors, folder / "mmproj.safetensors")
    add_to_index(folder, tensors)
    size = mm.vision_config["image_size"]
    processor = {"image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "do_rescale": True,
                 "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mm.image_mean),
                 "image_std": list(mm.image_std), "size": {"height": size, "width": size},
                 "do_pan_and_scan": False, "image_seq_length": mm.mm_tokens_per_image}
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n", encoding="utf-8")
