"""The attention seam: one context object carries a step's attention metadata to every layer.

The flat batch holds decode tokens first (one query per sequence), then prefill chunks. Each layer
stores its new K/V into the paged cache through the slot mapping, then runs decode attention on the
first part and prefill (context) attention on the rest. Which implementation runs (Triton kernels
or torch references) is chosen once, in `ops`. A local (sliding-window) layer's attention sees only
the last `window` positions of each query (`layer_windows`, from the model's configuration).

The slot mapping and the block tables carry the KV-cache group first (backend/kv/groups.py): a
layer stores and reads through its group's (`layer_groups`), in its cache tensors (`kv_caches`,
which layers of different groups share).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from backend.models.lora.project import LoRADeltas

from kernels.dispatch import KernelOps


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
        return self.ops.prefill_attention(q, k_cache, v_cache, self._prefill_tables[group],
                                          self.prefill_cu_seqlens_q, self.prefill_seq_lens, self.scale,
                                          max_q_len=self.prefill_max_q_len or None, window=window)
