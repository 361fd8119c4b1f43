"""The attention seam: one context object carries a step's attention metadata to every layer.

The flat batch holds decode tokens first (one query per sequence), then prefill chunks. Each layer
stores its new K/V into the paged cache through the slot mapping, then runs decode attention on the
first part and prefill (context) attention on the rest. Which implementation runs (Triton kernels
or torch references) is chosen once, in `ops`. A local (sliding-window) layer's attention sees only
the last `window` positions of each query (`layer_windows`, from the model's configuration).

The slot mapping and the block tables carry the KV-cache group first (backend/kv/groups.py): a
layer stores and reads through its group's (`layer_groups`), in its cache tensors (`kv_caches`,
which layers of different groups share).

Image placeholder tokens (docs/vision.md) attend to each other both ways within one image, as
transformers' Gemma 3 does: causal for text, full within each image's run (`image_spans`; a sliding
layer's window still bounds how far back a query reads). The prefill kernels are causal, so the
queries of an image's run are computed again here in torch over the keys up to the run's end
(`_image_attention`); the scheduler never splits a run across chunks, so those keys are stored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from backend.models.lora.project import LoRADeltas

from kernels.dispatch import KernelOps


@dataclass(frozen=True)
class ImageSpan:
    """The queries of one image's placeholder run in one prefill chunk: rows [q_lo, q_hi) of the
    step's prefill part, of prefill row `prefill_row`, at positions from `pos_lo`; the run is
    positions [span_lo, span_hi) of its sequence."""
    prefill_row: int
    q_lo: int
    q_hi: int
    pos_lo: int
    span_lo: int
    span_hi: int


@dataclass(kw_only=True)
class AttentionContext:
    ops: KernelOps
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k_cache, v_cache [NB, BS, G, D]
    scale: float
    slot_mapping: torch.Tensor  # [groups, T] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [groups, num_decodes, MB] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, the query's own token included
    prefill_block_tables: torch.Tensor  # [groups, num_prefills, MB] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, the chunk included
    decode_max_seq_len: int = 0  # host-side maxima, so no kernel launch waits on a device read
    prefill_max_q_len: int = 0
    lora: Optional[LoRADeltas] = None  # the step's LoRA adapter segments (backend/worker/lora/step.py); None: none
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 for full attention; (): all full
    layer_groups: tuple[int, ...] = ()  # per layer: its KV-cache group; (): one group
    image_spans: list[ImageSpan] = field(default_factory=list)  # bidirectional runs of the prefill rows
    # (rows, embeddings): the step's image rows, put in place of their token embeddings (llama.py)
    mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def __post_init__(self):
        # each group's views, made once: every layer of a group passes the same tensors, whose
        # bounds the kernels then check once a step (kernels/checks.py's bounds_checked)
        groups = range(self.slot_mapping.shape[0])
        self._slots = [self.slot_mapping[g] for g in groups]
        self._decode_tables = [self.decode_block_tables[g] for g in groups]
        self._prefill_tables = [self.prefill_block_tables[g] for g in groups]

    def group_of(self, layer: int) -> int:
        """The KV-cache group a layer stores and reads through."""
        return self.layer_groups[layer] if self.layer_groups else 0

    def window_of(self, layer: int) -> int:
        """A layer's sliding window; 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, G, D] -> [T, H, D]."""
        k_cache, v_cache = self.kv_caches[layer]
        group = self.group_of(layer)
        self.ops.store_kv(k, v, k_cache, v_cache, self._slots[group])
        window = self.window_of(layer)
        nd = self.num_decode_tokens
        if nd == q.shape[0]:
            return self._decode(q, k_cache, v_cache, group, window)
        if nd == 0:
            return self._prefill(q, k_cache, v_cache, group, window)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, group, window)
        out[nd:] = self._prefill(q[nd:], k_cache, v_cache, group, window)
        return out

    def _decode(self, q, k_cache, v_cache, group: int, window: int) -> torch.Tensor:
        return self.ops.decode_attention(q, k_cache, v_cache, self._decode_tables[group], self.decode_seq_lens,
                                         self.scale, max_seq_len=self.decode_max_seq_len or None, window=window)

    def _prefill(self, q, k_cache, v_cache, group: int, window: int) -> torch.Tensor:
        out = self.ops.prefill_attention(q, k_cache, v_cache, self._prefill_tables[group],
                                         self.prefill_cu_seqlens_q, self.prefill_seq_lens, self.scale,
                                         max_q_len=self.prefill_max_q_len or None, window=window)
        for span in self.image_spans:
            out[span.q_lo:span.q_hi] = self._image_attention(q[span.q_lo:span.q_hi], k_cache, v_cache,
                                                             self._prefill_tables[group][span.prefill_row],
                                                             span, window)
        return out

    def _image_attention(self, q, k_cache, v_cache, table, span: ImageSpan, window: int) -> torch.Tensor:
        """An image run's queries q [n, H, D] over their sequence's stored keys: allowed where the
        key is not later than the query or lies in the run, and (a sliding layer) within the window."""
        n, heads, _ = q.shape
        first = max(0, span.pos_lo - window + 1) if window else 0
        pos = torch.arange(first, span.span_hi, device=q.device)
        bs = k_cache.shape[1]
        blocks = table[pos // bs].long()
        k, v = k_cache[blocks, pos % bs].float(), v_cache[blocks, pos % bs].float()  # [L, G, D]
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
        qpos = torch.arange(span.pos_lo, span.pos_lo + n, device=q.device)[:, None]
        allowed = (pos[None, :] <= qpos) | ((pos[None, :] >= span.span_lo) & (pos[None, :] < span.span_hi))
        if window:
            allowed &= pos[None, :] > qpos - window
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * self.scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(q.dtype)
