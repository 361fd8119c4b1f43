"""Gemma 3's image encoder: the SigLIP vision tower and the multimodal projector, in plain torch
(docs/vision.md). transformers' Gemma3ForConditionalGeneration computes the same.

The tower cuts a [3, S, S] image into patches (a strided convolution), adds a learned position
embedding per patch, runs pre-norm encoder layers (LayerNorm, full attention with biases, a tanh-GELU
MLP) and a final LayerNorm. The projector average-pools the patch grid down to
`mm_tokens_per_image` tokens (a square), RMS-normalizes them (Gemma's 1 + w) and projects them to the
text model's hidden size. Their rows replace the prompt's image tokens (backend/models/llama.py).
Weights load under the names HF writes (`vision_tower.*` as transformers 5 saves them,
`vision_tower.vision_model.*` in the Hub's files, either under `model.`; `multi_modal_projector.*`); SigLIP's pooling head,
which Gemma 3 never runs, is skipped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from backend.models.checkpoint_config import CheckpointConfigError, Reader
from backend.models.loader import weight_files

_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")


@dataclass(frozen=True)
class VisionConfig:
    """What the tower, the projector and the prompt's placeholders need of config.json."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    text_hidden_size: int
    mm_tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    num_channels: int = 3

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def read_vision_config(model_dir: str | Path) -> Optional[VisionConfig]:
    """A Gemma3ForConditionalGeneration checkpoint's vision settings; None for a text-only model."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if "Gemma3ForConditionalGeneration" not in (cfg.get("architectures") or []) or not cfg.get("vision_config"):
        return None
    top, vision = Reader(cfg), Reader(cfg["vision_config"])
    text = cfg.get("text_config") or {}
    vc = VisionConfig(
        hidden_size=vision.integer("hidden_size", 1152), intermediate_size=vision.integer("intermediate_size", 4304),
        num_layers=vision.integer("num_hidden_layers", 27), num_heads=vision.integer("num_attention_heads", 16),
        image_size=vision.integer("image_size", 896), patch_size=vision.integer("patch_size", 14),
        layer_norm_eps=vision.number("layer_norm_eps", 1e-6), text_hidden_size=int(text.get("hidden_size", 2304)),
        mm_tokens_per_image=top.integer("mm_tokens_per_image", 256),
        image_token_id=top.integer("image_token_index", top.integer("image_token_id", 262_144)),
        boi_token_id=top.integer("boi_token_index", top.integer("boi_token_id", 255_999)),
        eoi_token_id=top.integer("eoi_token_index", top.integer("eoi_token_id", 256_000)),
        num_channels=vision.integer("num_channels", 3))
    side = int(round(vc.mm_tokens_per_image ** 0.5))
    if side * side != vc.mm_tokens_per_image or side == 0 or vc.patches_per_side % side:
        raise CheckpointConfigError(f"config.json: mm_tokens_per_image is {vc.mm_tokens_per_image}; it must be a "
                                    f"square whose side divides the {vc.patches_per_side} patches per side")
    if vc.hidden_size % vc.num_heads:
        raise CheckpointConfigError(f"config.json: vision_config.hidden_size {vc.hidden_size} is not a multiple of "
                                    f"num_attention_heads {vc.num_heads}")
    return vc


class _EncoderLayer(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        d = c.hidden_size
        self.heads = c.num_heads
        self.layer_norm1 = nn.LayerNorm(d, eps=c.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(d, eps=c.layer_norm_eps)
        self.qkv = nn.Linear(d, 3 * d)  # q_proj, k_proj, v_proj fused at load
        self.out_proj = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.layer_norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)  # full attention over the patches
        x = x + self.out_proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class Gemma3VisionEncoder(nn.Module):
    """pixel_values [N, 3, S, S] -> image embeddings [N, mm_tokens_per_image, text hidden]."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.cfg = c
        d = c.hidden_size
        self.patch_embedding = nn.Conv2d(c.num_channels, d, kernel_size=c.patch_size, stride=c.patch_size)
        self.position_embedding = nn.Parameter(torch.zeros(c.patches_per_side ** 2, d))
        self.layers = nn.ModuleList(_EncoderLayer(c) for _ in range(c.num_layers))
        self.post_layernorm = nn.LayerNorm(d, eps=c.layer_norm_eps)
        self.mm_soft_emb_norm = nn.Parameter(torch.zeros(d))  # Gemma's RMSNorm weight w (applied as 1 + w)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(d, c.text_hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        n, _, d = x.shape
        side, per_side = int(round(c.mm_tokens_per_image ** 0.5)), c.patches_per_side
        grid = x.transpose(1, 2).reshape(n, d, per_side, per_side)
        pooled = F.avg_pool2d(grid, kernel_size=per_side // side).flatten(2).transpose(1, 2)
        normed = pooled.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + c.layer_norm_eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)

    # -- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tower's and the projector's tensors among a checkpoint's (the rest skipped); fails on
        a missing one."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = _local_name(hf_name)
            if name is None:
                continue
            if ".self_attn." in name and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
                layer, part, kind = name.split(".")[1], name.split(".")[-2], name.split(".")[-1]
                d = self.cfg.hidden_size
                shard = ("q_proj", "k_proj", "v_proj").index(part)
                target = params[f"layers.{layer}.qkv.{kind}"]
                target.data[shard * d:(shard + 1) * d].copy_(tensor)
                loaded.add(f"layers.{layer}.qkv.{kind}#{shard}")
                continue
            if name not in params:
                raise ValueError(f"checkpoint has an unexpected vision weight '{hf_name}'")
            param = params[name]
            if name == "position_embedding" or param.shape == tensor.shape:
                param.data.copy_(tensor.reshape(param.shape))
            else:
                raise ValueError(f"vision weight '{hf_name}' has shape {tuple(tensor.shape)}; expected {tuple(param.shape)}")
            loaded.add(name)
        for name in list(loaded):
            if "#" in name and all(f"{name.split('#')[0]}#{i}" in loaded for i in range(3)):
                loaded.add(name.split("#")[0])
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing vision weights: {missing[:6]}")


def _local_name(hf_name: str) -> Optional[str]:
    """The encoder's own name of a checkpoint tensor; None for one it does not hold."""
    for prefix in _PREFIXES:
        if hf_name.startswith(prefix):
            name = hf_name[len(prefix):]
            if name.startswith("head."):  # SigLIP's pooling head: Gemma 3 never runs it
                return None
            name = name.replace("embeddings.patch_embedding.", "patch_embedding.")
            name = name.replace("embeddings.position_embedding.weight", "position_embedding")
            name = name.replace("encoder.layers.", "layers.").replace("self_attn.out_proj", "out_proj")
            return name.replace("mlp.fc1", "fc1").replace("mlp.fc2", "fc2")
    for prefix in _PROJECTOR:
        if hf_name.startswith(prefix):
            name = hf_name[len(prefix):]
            return "mm_soft_emb_norm" if name == "mm_soft_emb_norm.weight" else name
    return None


def vision_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tower's and the projector's tensors of a checkpoint, read alone (the text model's are not)."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if _local_name(name) is not None:
                    yield name, f.get_tensor(name)


def load_vision_encoder(model_dir: str | Path, weights, device: torch.device) -> Optional[Gemma3VisionEncoder]:
    """The checkpoint's image encoder in float32 on `device`, or None for a text-only model."""
    cfg = read_vision_config(model_dir)
    if cfg is None:
        return None
    encoder = Gemma3VisionEncoder(cfg)
    encoder.load_weights(weights)
    return encoder.to(device=device, dtype=torch.float32).eval()
