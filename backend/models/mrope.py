"""Multimodal rotary positions (M-RoPE) of Qwen2.5-VL (docs/vision.md), as transformers'
Qwen2_5_VLModel.get_rope_index and Qwen2_5_VLRotaryEmbedding compute them.

Every prompt token has three positions (time, height, width). A text token's three are equal, its
index plus the shift of the images before it; an image's tokens (its merged patch grid, H x W rows
of the prompt, row-major) sit at (s, s + row, s + column) from s, the position the image starts at;
the text after an image continues from the image's largest position + 1, so each image shifts what
follows by max(H, W) - H * W. A sequence's `delta` (transformers' rope delta) is the sum of those
shifts: every token after the prompt, decode rows included, is a plain 1-D position p + delta.

The rotary half of a head (head_dim / 2 frequencies) is cut into `mrope_section` (three counts, their
sum head_dim / 2): the first section's frequencies turn with the time position, the second with the
height, the third with the width. `mrope_rows` makes, for a step's rows, the cos/sin rows of those
positions out of the model's 1-D tables; any rotary kernel then applies them as rows 0..T-1 of a
table (Triton, C, torch alike), so no kernel needs a second form. `mrope_reference` is transformers'
formula, written apart, that the tests hold `mrope_rows` to. Plain numpy and torch; no weights.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from backend.models.checkpoint_config import CheckpointConfigError, shown

DEFAULT_THETA = 1_000_000.0  # Qwen2_5_VLTextConfig's default_theta


def text_config(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(the text model's config with M-RoPE read as the default rope, mrope_section) of a
    Qwen2_5_VLForConditionalGeneration config.json: transformers 5 nests the text model's keys in
    `text_config` (its rope in `rope_parameters`), the Hub's files keep them at the top level (their
    rope in `rope_scaling`, type "mrope")."""
    nested = cfg.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise CheckpointConfigError(f"config.json: text_config is {shown(nested)}; it must be a JSON object")
    text = {**{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}, **(nested or {})}
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if not isinstance(rope, dict):
            continue
        section = rope.get("mrope_section", section)
        if rope.get("rope_type", rope.get("type")) in ("mrope", "default", None):
            rest = {k: v for k, v in rope.items() if k not in ("mrope_section", "rope_type", "type")}
            text[key] = {**rest, "rope_type": "default"} if key == "rope_parameters" else None
    params = text.get("rope_parameters")
    if text.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        text["rope_theta"] = DEFAULT_THETA
    if section is None:
        section = [16, 24, 24]  # transformers' default
    if not (isinstance(section, list) and len(section) == 3
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)):
        raise CheckpointConfigError(f"config.json: mrope_section is {shown(section)}; it must be three counts "
                                    "(time, height, width) of rotary frequencies")
    return text, tuple(section)


def check_section(section: Sequence[int], head_dim: int) -> None:
    if sum(section) != head_dim // 2:
        raise CheckpointConfigError(f"config.json: mrope_section {list(section)} sums to {sum(section)}; it must "
                                    f"sum to head_dim / 2 = {head_dim // 2}")


def mrope_delta(items: Sequence) -> int:
    """A sequence's rope delta: what its images shift the positions after them by."""
    return sum(max(item.grid) - item.length for item in items)


def mrope_positions(items: Sequence, start: int, n: int) -> np.ndarray:
    """int64 [3, n]: the (time, height, width) positions of tokens start..start+n-1 of a sequence
    whose prompt holds `items` (ImageItem: offset, length, grid (H, W) of merged patches), in order."""
    index = np.arange(start, start + n, dtype=np.int64)
    out = np.empty((3, n), dtype=np.int64)
    shift = np.zeros(n, dtype=np.int64)
    inside = np.zeros(n, dtype=bool)
    before = 0  # the shift of the images before the current one
    for item in sorted(items, key=lambda i: i.offset):
        height, width = item.grid
        if height * width != item.length:
            raise ValueError(f"an image's grid {height}x{width} does not match its {item.length} tokens")
        rows = (index >= item.offset) & (index < item.end)
        if rows.any():
            j = index[rows] - item.offset
            s = item.offset + before
            out[0, rows], out[1, rows], out[2, rows] = s, s + j // width, s + j % width
            inside |= rows
        before += max(height, width) - item.length
        shift[index >= item.end] = before
    text = index + shift
    out[:, ~inside] = text[~inside]
    return out


def mrope_rows(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               section: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin rows [T, head_dim / 2] of `positions` [3, T] from the 1-D tables [max_pos, head_dim / 2]:
    section i's columns read stream i's position."""
    pos = positions.long()
    parts_cos, parts_sin, lo = [], [], 0
    for stream, width in enumerate(section):
        parts_cos.append(cos[pos[stream], lo:lo + width])
        parts_sin.append(sin[pos[stream], lo:lo + width])
        lo += width
    return torch.cat(parts_cos, dim=-1).contiguous(), torch.cat(parts_sin, dim=-1).contiguous()


def mrope_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                    section: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' M-RoPE on q [T, H, D], k [T, G, D] at positions [3, T]: the frequencies of all
    three streams, the full-width cos/sin recomposed from the sections (doubled, as
    Qwen2_5_VLRotaryEmbedding.recomposition_frequencies), then rotate-half."""
    freqs = positions[..., None].float() * inv_freq.float()  # [3, T, D/2]
    cos, sin = freqs.cos(), freqs.sin()

    def recompose(f: torch.Tensor) -> torch.Tensor:
        half = torch.cat([m[i % 3] for i, m in enumerate(f.split(list(section), dim=-1))], dim=-1)
        return torch.cat((half, half), dim=-1)[:, None, :]  # [T, 1, D]

    c, s = recompose(cos), recompose(sin)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * c + rotated * s).to(x.dtype)

    return rot(q), rot(k)
