"""Each step's attention metadata: the `AttentionContext` every layer reads (models/attention.py),
built from the step's flat inputs (step_inputs.py) and the block tables of the persistent batch
(input_batch.py), and the contexts of the other forward passes the worker runs (the CUDA graphs'
static buffers, a throwaway prefill for scoring texts)."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from backend.models.attention import AttentionContext
from backend.worker.step_inputs import StepInputs


class AttentionMetadata:
    def __init__(self, ops, model_cfg, kv_layout, max_model_len: int, block_size: int, device: torch.device):
        self.ops = ops
        self.model_cfg = model_cfg
        self.kv_layout = kv_layout
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device

    def context(self, **fields) -> AttentionContext:
        cfg = self.model_cfg
        groups = self.kv_layout.layer_group if self.kv_layout.num_groups > 1 else ()
        return AttentionContext(ops=self.ops, scale=cfg.attention_scale, layer_windows=cfg.layer_windows,
                                layer_groups=groups, **fields)

    def for_step(self, step: StepInputs, table: torch.Tensor, kv_caches: list, lora) -> AttentionContext:
        """`table`: the block tables [groups, rows, width]; each row set gathered on the device."""
        # The Triton kernel's split count follows the batch and this bound only, so an eager decode
        # and a graph replay of the same batch launch the same; the references pad to the real max.
        max_seq_len = self.max_model_len if self.ops.name == "triton" else step.decode_max_seq_len
        images = getattr(step, "images", None)  # a vision-language model's image rows (vision.py)
        return self.context(
            kv_caches=kv_caches, slot_mapping=step.slot_mapping, num_decode_tokens=step.num_decode_rows,
            decode_block_tables=table[:, :, :step.decode_width].index_select(1, step.decode_rows),
            decode_seq_lens=step.decode_seq_lens,
            prefill_block_tables=table[:, :, :step.prefill_width].index_select(1, step.prefill_rows),
            prefill_cu_seqlens_q=step.prefill_cu_seqlens_q, prefill_seq_lens=step.prefill_seq_lens,
            decode_max_seq_len=max_seq_len, prefill_max_q_len=step.prefill_max_q_len, lora=lora,
            image_spans=images.spans if images else [], mm_embeds=(images.rows, images.embeds) if images else None)

    def for_graphs(self, kv_caches: list, table: torch.Tensor) -> Callable[..., AttentionContext]:
        """The context maker of the CUDA graphs' static buffers (cuda_graphs.py): decode rows only."""
        empty_i32 = torch.zeros(1, dtype=torch.int32, device=self.device)
        return functools.partial(
            self.context, kv_caches=kv_caches, prefill_block_tables=table[:, :0], prefill_cu_seqlens_q=empty_i32,
            prefill_seq_lens=empty_i32[:0], decode_max_seq_len=self.max_model_len)

    def for_prefill(self, num_tokens: int, kv_caches: list) -> AttentionContext:
        """One sequence's prefill of num_tokens tokens from position 0 on `kv_caches`, a throwaway
        cache of its own (client/tools/quality/perplexity.py scores texts this way)."""
        bs, groups, dev = self.block_size, self.kv_layout.num_groups, self.device
        blocks = -(-num_tokens // bs)
        table = torch.arange(groups * blocks, dtype=torch.int32, device=dev).view(groups, 1, blocks)  # a group each
        positions = torch.arange(num_tokens, device=dev)
        slots = (table[:, 0, positions // bs] * bs + positions % bs).long()
        lens = torch.tensor([num_tokens], dtype=torch.int32, device=dev)
        return self.context(kv_caches=kv_caches, slot_mapping=slots, num_decode_tokens=0,
                            decode_block_tables=table[:, :0], decode_seq_lens=lens[:0], prefill_block_tables=table,
                            prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
                            prefill_seq_lens=lens, prefill_max_q_len=num_tokens)
