"""Images in the worker's step (docs/vision.md): the image encoder runs here, the only device-facing
layer, and its outputs are kept in a bounded cache by image hash.

For each prefill chunk that covers image placeholder tokens, `VisionStep.prepare` finds the image's
embeddings (the cache, else one encoder run for every image of the step it lacks), and returns the
flat rows they replace and the bidirectional spans the attention must honour
(backend/models/attention.py `ImageSpan`). The scheduler never ends a chunk inside an image's
placeholders (backend/core/multimodal.py `chunk_end`), so every span's keys are in the cache or the
chunk when its queries run.

The cache (`EncoderCache`) holds at most `encoder_cache_bytes`; an entry some held sequence still
needs (its placeholders not all computed) is pinned, the others are kept for a later request with the
same image and evicted least recently used first when room is needed. Counters: encoder runs (images
encoded), cache hits, and the bytes held (llm.stats(), the metrics).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from backend.models.attention import ImageSpan
from backend.models.gemma3_vision import load_vision_encoder, vision_weights
from backend.models.qwen2_5_vl_vision import QwenVisionEncoder, load_qwen_vision_encoder
from backend.worker.step_inputs import step_rows


class EncoderCache:
    """Encoder outputs by image hash, within a byte budget."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0

    def get(self, key: str) -> Optional[torch.Tensor]:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor, pinned: set[str]) -> None:
        size = self._size(value)
        self.trim(pinned, room=size)
        self.entries[key] = value  # (pinned entries may take it past the budget until they are not)
        self.bytes += size

    def trim(self, pinned: set[str], room: int = 0) -> None:
        """Evict unpinned entries, least recently used first, until `room` more bytes fit the budget."""
        for old in [k for k in self.entries if k not in pinned]:
            if self.bytes + room <= self.budget:
                break
            self.bytes -= self._size(self.entries.pop(old))

    @staticmethod
    def _size(value: torch.Tensor) -> int:
        return value.numel() * value.element_size()


@dataclass
class VisionInputs:
    """One step's image rows: the flat rows replaced (`rows`) by `embeds`, and the spans."""
    rows: torch.Tensor
    embeds: torch.Tensor
    spans: list[ImageSpan] = field(default_factory=list)


class VisionStep:
    """The encoder of a vision-language checkpoint and its cache, on the worker's device."""

    def __init__(self, encoder, cache_bytes: int, device: torch.device, verify_as_decode: bool = False):
        self.encoder = encoder
        self.verify_as_decode = verify_as_decode  # the step's row order (step_inputs.step_rows)
        self.cfg = encoder.cfg
        self.device = device
        self.cache = EncoderCache(cache_bytes)
        self.runs = 0  # images encoded
        self.items: dict[str, tuple] = {}  # seq_id -> its ImageItems, while the worker holds it

    def track(self, plan) -> None:
        """The images of the plan's new sequences, kept until the plan says they finished."""
        for new in plan.new_seqs:
            if new.mm_items:
                self.items[new.seq_id] = tuple(new.mm_items)
        for seq_id in plan.finished_ids:
            self.items.pop(seq_id, None)

    @classmethod
    def build(cls, config, tp, device: torch.device, verify_as_decode: bool) -> Optional["VisionStep"]:
        """The checkpoint's image encoder and its cache; None for a text-only model."""
        encoder = load_qwen_vision_encoder(config.model_path, device)  # Qwen2.5-VL, else Gemma 3 (else None)
        if encoder is None:
            encoder = load_vision_encoder(config.model_path, vision_weights(config.model_path), device)
        if encoder is None:
            return None
        if tp is not None:
            raise ValueError("images with tensor_parallel_size > 1 are not supported yet (docs/vision.md)")
        return cls(encoder, config.encoder_cache_bytes, device, verify_as_decode)

    def stats(self) -> dict[str, int]:
        return {"encoder_runs_total": self.runs, "encoder_cache_hits_total": self.cache.hits,
                "encoder_cache_bytes": self.cache.bytes, "encoder_cache_entries": len(self.cache.entries)}

    def prepare(self, plan, batch, empty_rows: int) -> Optional[VisionInputs]:
        """The step's image rows and spans (the plan already applied to `batch`), the encoder run for
        the images not cached; None when no chunk covers an image."""
        self.track(plan)
        for seq_id in [s for s in self.items if s not in batch.seqs]:  # (finished in an empty plan)
            del self.items[seq_id]
        if self.cache.bytes > self.cache.budget:  # a put past the budget while its images were pinned
            self.cache.trim(self._pinned(batch.seqs))
        if not self.items or not plan.prefills:  # (decode steps: no image row)
            return None
        decodes, prefills = step_rows(plan, batch, self.verify_as_decode)
        at = empty_rows + sum(r.num_new_tokens for r in decodes)
        wanted = []  # (item, flat row of the chunk's start, chunk start, chunk end, prefill index)
        q_at = 0
        for p, r in enumerate(prefills):
            end = r.start + r.num_new_tokens
            for item in self.items.get(r.seq_id, ()) if not r.padding else ():
                if item.offset < end and item.end > r.start:
                    if item.end > end:
                        raise RuntimeError(f"{r.seq_id}: a chunk ends inside an image (tokens {item.offset}-"
                                           f"{item.end}, chunk to {end}): the scheduler must not split one")
                    wanted.append((item, at, r.start, q_at, p))
            at += r.num_new_tokens
            q_at += r.num_new_tokens
        if not wanted:
            return None
        embeds = self._embeddings([w[0] for w in wanted], self._pinned(batch.seqs))
        rows, parts, spans = [], [], []
        for item, chunk_row, start, q_start, p in wanted:
            lo = max(item.offset, start)
            rows += range(chunk_row + lo - start, chunk_row + item.end - start)
            parts.append(embeds[item.hash][lo - item.offset:])
            spans.append(ImageSpan(prefill_row=p, q_lo=q_start + lo - start, q_hi=q_start + item.end - start,
                                   pos_lo=lo, span_lo=item.offset, span_hi=item.end))
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)
        bidirectional = getattr(self.cfg, "bidirectional", True)  # Qwen2.5-VL: causal image tokens, no span
        return VisionInputs(index, torch.cat(parts), spans if bidirectional else [])

    def _pinned(self, seqs) -> set[str]:
        """Hashes of images whose placeholders a held sequence has not all computed."""
        return {item.hash for seq_id, items in self.items.items() for item in items
                if seq_id in seqs and item.end > seqs[seq_id].num_computed_tokens}

    def _embeddings(self, items: list, pinned: set[str]) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, object] = {}
        for item in items:
            if item.hash in found or item.hash in missing:
                continue
            cached = self.cache.get(item.hash)
            if cached is not None:
                self.cache.hits += 1
                found[item.hash] = cached
            else:
                missing[item.hash] = item
        if missing:
            pixels = [torch.from_numpy(m.pixel_values).to(self.device) for m in missing.values()]
            with torch.inference_mode():
                # (Qwen2.5-VL: a list, its images differ in size; Gemma 3: one batch)
                qwen = isinstance(self.encoder, QwenVisionEncoder)
                out = self.encoder(pixels) if qwen else self.encoder(torch.stack(pixels))
            self.runs += len(missing)
            for key, value in zip(missing, out):
                value = value.clone()
                self.cache.put(key, value, pinned)
                found[key] = value
        return found


def encoder_stats(runner) -> dict[str, int]:
    """The runner's encoder figures (zeros for a text-only model), for llm.stats() and the metrics."""
    vision = getattr(runner, "vision", None)
    if vision is None:
        return {"encoder_runs_total": 0, "encoder_cache_hits_total": 0, "encoder_cache_bytes": 0,
                "encoder_cache_entries": 0}
    return vision.stats()
