"""RoPE cos/sin caches, built the way HF transformers computes `inv_freq` (default, "linear" and
"llama3" rope types), so a model's positions match HF's exactly. Plain torch: applying the rotation
is a kernel (kernels/gpu/rope.py and its reference), building the table is model code."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: Optional[dict] = None) -> torch.Tensor:
    """inv_freq [head_dim/2] float32, computed with the same float32 operations, in the same order,
    as HF transformers' ROPE_INIT_FUNCTIONS (default, "linear", "llama3")."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope: head_dim must be a positive even number; got {head_dim}")
    if not theta > 0:
        raise ValueError(f"rope: theta must be > 0; got {theta}")
    base = float(theta)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        try:
            factor = rope_scaling["factor"]
            low_freq_factor = rope_scaling["low_freq_factor"]
            high_freq_factor = rope_scaling["high_freq_factor"]
            old_context_len = rope_scaling["original_max_position_embeddings"]
        except KeyError as e:
            raise ValueError(f"rope: llama3 rope_scaling needs factor, low_freq_factor, high_freq_factor and "
                             f"original_max_position_embeddings; missing {e}") from None
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # wavelen < high_freq_wavelen: keep; wavelen > low_freq_wavelen: divide by factor;
        # in between: interpolate smoothly.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    raise ValueError(f"rope: rope_scaling type '{rope_type}' is not supported (supported: default, linear, "
                     f"llama3)")


def rope_cos_sin(head_dim: int, max_position: int, theta: float,
                 rope_scaling: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin caches [max_position, head_dim/2] float32 (CPU; move them to the model's device).
    Row p is cos/sin(p * inv_freq), as HF's rotary embedding computes for position p (fp32)."""
    if max_position <= 0:
        raise ValueError(f"rope: max_position must be > 0; got {max_position}")
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
    freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


class RopeTables(NamedTuple):
    """The cos/sin tables a model's layers read: global (full-attention) layers `full`, local
    (sliding-window) layers `local`, the same tables unless the model gives its local layers their
    own base (Gemma 3: rope_local_base_freq 10,000 against 1,000,000, and the global layers alone
    scaled)."""
    full: tuple[torch.Tensor, torch.Tensor]
    local: tuple[torch.Tensor, torch.Tensor]

    def for_layer(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local if window else self.full


def rope_tables(cfg, max_position: int, device: torch.device) -> RopeTables:
    """The RopeTables of a ModelConfig, rows 0..max_position-1, on `device`."""
    full = tuple(t.to(device) for t in rope_cos_sin(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling))
    if cfg.local_rope_theta is None:
        return RopeTables(full, full)
    local = rope_cos_sin(cfg.head_dim, max_position, cfg.local_rope_theta, cfg.local_rope_scaling)
    return RopeTables(full, tuple(t.to(device) for t in local))
