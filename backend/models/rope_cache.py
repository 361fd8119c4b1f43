"""Rotary embedding tables: inverse frequencies as Hugging Face computes them (default and llama3
scaling), expanded once into cos/sin caches indexed by position."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_scaling type '{kind}' is not supported (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin caches [max_position, head_dim // 2] in float32."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()
