"""Qwen2.5-VL's image encoder in plain torch (docs/vision.md); transformers'
Qwen2_5_VisionTransformerPretrainedModel computes the same.

An image arrives resized to multiples of patch * merge pixels (backend/engine/qwen2_5_vl_images.py)
as [3, H, W]. It is cut into patch x patch squares, ordered as the processor flattens them: by
merge x merge block (row-major), then within the block; each square is seen twice over time
(`temporal_patch_size` 2: a still image is its own second frame, as transformers' processor repeats
it) and embedded by the checkpoint's Conv3d (a matmul here: the kernel equals the stride). The blocks
(RMSNorm, attention with biases, a gated SiLU MLP with biases) rotate q and k by the patch's row
and column (2-D RoPE: head_dim / 4 frequencies each, base `rope_theta`); every block attends within
windows of `window_size` pixels (window_size / patch / merge merged patches a side), the blocks at
`fullatt_block_indexes` over the whole image. The patch merger RMS-normalizes, concatenates each
block's merge x merge patches and projects them (Linear, GELU, Linear) to the text model's width:
one row per merged patch, row-major over the merged grid, the image's tokens in the prompt.
Images are encoded one by one (windows and attention never cross an image). Weights load under
the names transformers 5 writes (`model.visual.*`) or the Hub's (`visual.*`).
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

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
_PREFIXES = ("model.visual.", "visual.")
_EPS = 1e-6


@dataclass(frozen=True)
class QwenVisionConfig:
    """What the encoder and the prompt's placeholders need of config.json."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    in_channels: int = 3
    hidden_act: str = "silu"
    bidirectional = False  # the prompt's image tokens attend causally (no ImageSpan)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def factor(self) -> int:
        """An image's sides are multiples of this many pixels."""
        return self.patch_size * self.spatial_merge_size


def is_qwen2_5_vl(model_dir: str | Path) -> bool:
    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return ARCHITECTURE in (cfg.get("architectures") or [])


def read_qwen_vision_config(model_dir: str | Path) -> Optional[QwenVisionConfig]:
    """A Qwen2_5_VLForConditionalGeneration checkpoint's vision settings; None for another model."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        return None
    top, v = Reader(cfg), Reader(cfg.get("vision_config") or {}, prefix="vision_config.")
    text = cfg.get("text_config") or cfg
    rope = Reader((cfg.get("vision_config") or {}).get("rope_parameters") or {}, prefix="vision_config.rope_parameters.")
    full = (cfg.get("vision_config") or {}).get("fullatt_block_indexes", [7, 15, 23, 31])
    if not isinstance(full, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in full):
        v.fail("fullatt_block_indexes", full, "a list of block indexes")
    c = QwenVisionConfig(
        depth=v.integer("depth", 32), hidden_size=v.integer("hidden_size", 3584),
        intermediate_size=v.integer("intermediate_size", 3420), num_heads=v.integer("num_heads", 16),
        patch_size=v.integer("patch_size", 14), temporal_patch_size=v.integer("temporal_patch_size", 2),
        spatial_merge_size=v.integer("spatial_merge_size", 2), window_size=v.integer("window_size", 112),
        fullatt_block_indexes=tuple(int(i) for i in full),
        out_hidden_size=v.integer("out_hidden_size", int(text.get("hidden_size", 3584))),
        rope_theta=rope.number("rope_theta", 10_000.0), in_channels=v.integer("in_channels", 3),
        image_token_id=top.integer("image_token_id", 151_655, low=0),
        vision_start_token_id=top.integer("vision_start_token_id", 151_652, low=0),
        vision_end_token_id=top.integer("vision_end_token_id", 151_653, low=0),
        hidden_act=str((cfg.get("vision_config") or {}).get("hidden_act", "silu")))
    if c.hidden_size % c.num_heads or c.head_dim % 4:
        raise CheckpointConfigError(f"config.json: vision_config.hidden_size {c.hidden_size} over num_heads "
                                    f"{c.num_heads} must give a head_dim that is a multiple of 4 (2-D rotary)")
    if c.window_size % c.factor:
        raise CheckpointConfigError(f"config.json: vision_config.window_size {c.window_size} must be a multiple of "
                                    f"patch_size x spatial_merge_size = {c.factor}")
    if c.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"):
        raise CheckpointConfigError(f"config.json: vision_config.hidden_act {c.hidden_act!r} is not supported")
    return c


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x)


class _RMSNorm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _EPS)).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, c: QwenVisionConfig):
        super().__init__()
        d = c.hidden_size
        self.heads, self.act = c.num_heads, c.hidden_act
        self.norm1, self.norm2 = _RMSNorm(d), _RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.gate_proj = nn.Linear(d, c.intermediate_size)
        self.up_proj = nn.Linear(d, c.intermediate_size)
        self.down_proj = nn.Linear(c.intermediate_size, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: Optional[list]) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, d // self.heads).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, hd]
        if windows is None:
            attn = F.scaled_dot_product_attention(q, k, v)
        else:  # windows of equal length attend as one batch
            attn = torch.empty_like(q)
            for index in windows:  # [windows, length] rows of x
                out = F.scaled_dot_product_attention(q[:, index], k[:, index], v[:, index])  # [h, w, L, hd]
                attn[:, index] = out
        x = x + self.proj(attn.transpose(0, 1).reshape(n, d))
        h = self.norm2(x)
        return x + self.down_proj(_act(self.act, self.gate_proj(h)) * self.up_proj(h))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [n, heads, hd] by cos/sin [n, hd] (float32, as transformers)."""
    xf, half = x.float(), x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class QwenVisionEncoder(nn.Module):
    """[3, H, W] images (H, W multiples of patch * merge) -> [H * W / (patch * merge)^2, text hidden] each."""

    def __init__(self, c: QwenVisionConfig):
        super().__init__()
        self.cfg = c
        self.patch_embed = nn.Parameter(torch.zeros(c.hidden_size, c.in_channels * c.temporal_patch_size
                                                    * c.patch_size ** 2))  # Conv3d's kernel, flattened
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.depth))
        merged = c.hidden_size * c.spatial_merge_size ** 2
        self.ln_q = _RMSNorm(c.hidden_size)
        self.mlp0 = nn.Linear(merged, merged)
        self.mlp2 = nn.Linear(merged, c.out_hidden_size)
        dim = c.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)),
                             persistent=False)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._one(image) for image in images]

    def _one(self, pixels: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        m, ps, tp = c.spatial_merge_size, c.patch_size, c.temporal_patch_size
        ch, height, width = pixels.shape
        gh, gw = height // ps, width // ps  # patches a side; merged grid gh/m x gw/m
        x = pixels.to(self.patch_embed.dtype).reshape(ch, gh // m, m, ps, gw // m, m, ps).permute(1, 4, 2, 5, 0, 3, 6)
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], tp, ps, ps)  # the still image as its own 2nd frame
        x = x.reshape(gh * gw, -1) @ self.patch_embed.t()
        # each patch's row and column, in the same (block, then within the block) order
        rows = torch.arange(gh).view(gh // m, m, 1, 1).expand(gh // m, m, gw // m, m).permute(0, 2, 1, 3).reshape(-1)
        cols = torch.arange(gw).view(1, 1, gw // m, m).expand(gh // m, m, gw // m, m).permute(0, 2, 1, 3).reshape(-1)
        order, windows = self._windows(gh // m, gw // m)
        patch_order = (order[:, None] * m * m + torch.arange(m * m)).reshape(-1)
        x, rows, cols = x[patch_order.to(x.device)], rows[patch_order].to(x.device), cols[patch_order].to(x.device)
        freqs = torch.cat((rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq), dim=-1)
        freqs = torch.cat((freqs, freqs), dim=-1)
        cos, sin = freqs.cos(), freqs.sin()
        windows = [w.to(x.device) for w in windows]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if i in c.fullatt_block_indexes else windows)
        merged = self.mlp2(F.gelu(self.mlp0(self.ln_q(x).view(-1, self.mlp0.in_features))))
        return merged[torch.argsort(order).to(merged.device)]

    def _windows(self, mh: int, mw: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the merged patches in window order, each window's patch rows grouped by length): windows
        of `side` x `side` merged patches, row-major, each row-major inside (transformers' window index)."""
        c = self.cfg
        side, unit = c.window_size // c.factor, c.spatial_merge_size ** 2
        grid = torch.arange(mh * mw).view(mh, mw)
        parts = [grid[r:r + side, q:q + side].reshape(-1) for r in range(0, mh, side) for q in range(0, mw, side)]
        order = torch.cat(parts)
        by_length: dict[int, list[torch.Tensor]] = {}
        at = 0
        for part in parts:
            n = part.numel() * unit
            by_length.setdefault(n, []).append(torch.arange(at, at + n))
            at += n
        return order, [torch.stack(group) for group in by_length.values()]

    # -- weights --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The encoder's tensors among a checkpoint's (the rest skipped); fails on a missing one."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = local_name(hf_name)
            if name is None:
                continue
            if name not in params:
                raise ValueError(f"checkpoint has an unexpected vision weight '{hf_name}'")
            param = params[name]
            if param.numel() != tensor.numel() or (name != "patch_embed" and param.shape != tensor.shape):
                raise ValueError(f"vision weight '{hf_name}' has shape {tuple(tensor.shape)}; expected "
                                 f"{tuple(param.shape)}")
            param.data.copy_(tensor.reshape(param.shape))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing vision weights: {missing[:6]}")


def local_name(hf_name: str) -> Optional[str]:
    """The encoder's own name of a checkpoint tensor; None for one it does not hold."""
    prefix = next((p for p in _PREFIXES if hf_name.startswith(p)), None)
    if prefix is None:
        return None
    name = hf_name[len(prefix):]
    if name == "patch_embed.proj.weight":
        return "patch_embed"
    if name.startswith("merger."):
        return name.replace("merger.ln_q.", "ln_q.").replace("merger.mlp.0.", "mlp0.").replace("merger.mlp.2.", "mlp2.")
    if "rotary_pos_emb" in name:  # (a buffer some files carry: recomputed here)
        return None
    return name.replace(".attn.qkv.", ".qkv.").replace(".attn.proj.", ".proj.").replace(".mlp.", ".")


def qwen_vision_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The encoder's tensors of a checkpoint, read alone (the text model's are not)."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if local_name(name) is not None:
                    yield name, f.get_tensor(name)


def load_qwen_vision_encoder(model_dir: str | Path, device: torch.device) -> Optional[QwenVisionEncoder]:
    """The checkpoint's image encoder in float32 on `device`, or None for another model."""
    cfg = read_qwen_vision_config(model_dir)
    if cfg is None:
        return None
    encoder = QwenVisionEncoder(cfg)
    encoder.load_weights(qwen_vision_weights(model_dir))
    return encoder.to(device=device, dtype=torch.float32).eval()
