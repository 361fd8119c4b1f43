"""The model's tensor-parallel seams, as wrappers around whatever layer the loader built (float,
oneDNN-packed or packed-quantized): the layers themselves compute their shard as usual.

- `RowParallel` (o_proj, down_proj, and a mixture-of-experts block whole): the shard's partial
  output (plus its LoRA deltas), then one all-reduce;
- `VocabParallelEmbedding`: each rank looks up the tokens of its vocabulary rows, zeros the others,
  and one all-reduce gives every rank every token's embedding;
- `VocabParallelHead`: each rank's logits over its vocabulary rows, gathered side by side (all-gather)
  and cut to the vocabulary; only rank 0 samples from them.
"""
from __future__ import annotations

import torch
from torch import nn

from backend.models.moe import SparseMoeBlock
from backend.models.parallel.plan import ShardPlan


class RowParallel(nn.Module):
    """`partial(x)` is this rank's share of the output and `reduce` sums the shares: a LoRA delta
    joins the share before the sum (backend/worker/lora/step.py's lora_project), at no extra collective."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner = inner
        self.group = group

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:   # a whole block (a mixture of experts, called like the MLP): its output is partial
            return self.reduce(self.inner(x, *args, **kwargs))
        return self.reduce(self.partial(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, inner: nn.Module, plan: ShardPlan, group):
        super().__init__()
        self.inner = inner
        self.start, self.rows = plan.vocab_start, plan.vocab_end - plan.vocab_start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = self.inner(torch.where(mine, local, 0))
        return self.group.all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0))


class VocabParallelHead(nn.Module):
    def __init__(self, inner: nn.Module, plan: ShardPlan, group):
        super().__init__()
        self.inner = inner
        self.vocab_size = plan.vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.inner(hidden))[..., :self.vocab_size]


def parallelize(model: nn.Module, plan: ShardPlan, group) -> None:
    """Wrap the loaded shard's row-parallel projections, embedding and LM head, in place."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        if isinstance(layer.mlp, SparseMoeBlock):   # every expert's down projection is row-parallel
            layer.mlp = RowParallel(layer.mlp, group)
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, plan, group)
    model.lm_head = VocabParallelHead(model.lm_head, plan, group)
