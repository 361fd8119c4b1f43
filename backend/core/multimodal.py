"""Images in a request, as data (docs/vision.md): where each image's placeholder tokens sit in the
prompt, the pixels the worker's encoder reads, and the image's content hash. No torch here.

A vision-language prompt holds, for each image, a run of `length` placeholder tokens from `offset`
(Gemma 3: `mm_tokens_per_image` image tokens between its begin- and end-of-image tokens); the
worker puts the image's projected embeddings in their place, and their attention is bidirectional
within the run (backend/models/attention.py). The rules every layer shares live here:

- `chunk_end`: a prompt chunk never ends inside an image's run, so one image's tokens are computed
  in one step (vLLM's rule for its encoder's outputs): the chunk is cut before the run, or taken to
  its end, or (when the run does not fit the step's budget) not run this step.
- `keyed_tokens`: the prefix cache's keys read each placeholder as a negative number drawn from its
  image's hash and its place in the run (token ids are never negative), so two requests with the
  same image share blocks and different images never do, while the text before the first image
  keys as plain text (vLLM's extra keys of a block, folded into its tokens).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass
class ImageItem:
    """One image of a prompt: its placeholder run and its preprocessed pixels."""
    hash: str  # sha256 of the preprocessed pixels (hex): the encoder cache's and the prefix cache's key
    offset: int  # its first placeholder token's position in the prompt
    length: int  # placeholder tokens (the encoder's output rows)
    pixel_values: Any = None  # numpy float32 [channels, height, width], as the processor made them
    # Qwen2.5-VL: its tokens' grid (rows, columns of merged patches; length = rows * columns), which
    # sets their M-RoPE positions (backend/models/mrope.py); () for a fixed-size image (Gemma 3)
    grid: tuple = ()

    @property
    def end(self) -> int:
        return self.offset + self.length


def chunk_end(items: Sequence[ImageItem], start: int, n: int) -> int:
    """How many of the n tokens from `start` a chunk may take so that it ends outside every image
    run: n, or fewer (0: none this step)."""
    end = start + n
    for item in items:
        if item.offset < end < item.end:
            # the run starts in this chunk (or in the cache, after a prefix hit) and ends after it
            return max(0, item.offset - start) if item.offset > start else 0
    return n


class EncoderBudget:
    """The image tokens the encoder may still take this step (max_num_encoder_input_tokens, else
    max_num_batched_tokens; vLLM's encoder budget): the scheduler resets it each step. `room`: the
    step's token budget left, which the scheduler sets before each chunk it asks for: a chunk capped
    below it (prefill pacing) may still take an image whole rather than wait for a larger cap."""

    def __init__(self, config):
        self.total = config.max_num_encoder_input_tokens or config.max_num_batched_tokens
        self.left = self.total
        self.room: "int | None" = None

    def reset(self) -> None:
        self.left, self.room = self.total, None


def image_chunk(items: Sequence[ImageItem], start: int, n: int, budget: "EncoderBudget | None" = None) -> int:
    """`chunk_end`, then cut before the first image the step's encoder budget has no room for
    (whose tokens it takes from the budget). A chunk that could only end inside an image is taken to
    the image's end when the step's `room` holds it (else pacing could starve an image forever)."""
    m = chunk_end(items, start, n)
    if m == 0 and n > 0 and budget is not None and budget.room:
        inside = next(item for item in items if item.offset < start + n < item.end)
        if inside.end - start <= budget.room:
            m = inside.end - start
    n = m
    if budget is None or n == 0:
        return n
    used = 0
    for item in items:
        if item.end > start and item.offset < start + n:
            if used + item.length > budget.left:
                n = max(0, item.offset - start)
                break
            used += item.length
    budget.left -= used if n else 0
    return n


def keyed_tokens(tokens: Sequence[int], items: Sequence[ImageItem]) -> list[int]:
    """The tokens the prefix cache hashes: placeholders replaced by their image's key."""
    out = list(tokens)
    for item in items:
        base = int(item.hash[:15], 16)  # 60 bits of the image's hash
        for i in range(item.offset, min(item.end, len(out))):
            out[i] = -1 - ((base + i - item.offset) & ((1 << 62) - 1))
    return out


def image_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `image_token_id` in the prompt, in order."""
    runs, i, n = [], 0, len(token_ids)
    while i < n:
        if token_ids[i] == image_token_id:
            j = i
            while j < n and token_ids[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def expand_placeholders(token_ids: Sequence[int], boi: int, eoi: int, image: int, per_image: int,
                        around: Sequence[int] = ()) -> list[int]:
    """Token ids with each begin-of-image token `boi` expanded to `around`, boi, `per_image` image
    tokens, eoi, `around` (Gemma 3's image sequence; `around`: its blank line's tokens)."""
    out: list[int] = []
    for t in token_ids:
        out += [*around, boi, *([image] * per_image), eoi, *around] if t == boi else [t]
    return out


def images_per_prompt(value: Any) -> int:
    """limit_mm_per_prompt (a count, or vLLM's JSON {"image": N}) as the image count; ValueError
    naming the key."""
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else None
        except ValueError:
            parsed = None
    if isinstance(parsed, Mapping):
        unknown = sorted(set(parsed) - {"image"})
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: {unknown[0]!r} is not a modality inflight serves (image)")
        parsed = parsed.get("image", 0)
    if isinstance(parsed, bool) or not isinstance(parsed, int) or not 0 <= parsed <= 1024:
        raise ValueError(f"limit_mm_per_prompt must be an image count in [0, 1024] or {{\"image\": N}}; got {value!r}")
    return parsed
