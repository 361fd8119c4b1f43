"""Mixture-of-experts in torch: the router, the token -> expert sort, and the experts' computation.

These are the oracle of the fused-MoE Triton kernel (kernels/gpu/fused_moe.py, same signature) and the
CPU engine's path (docs/design.md, "Mixture of experts").

Shapes (T tokens, H hidden, E experts, I an expert's intermediate size, K experts per token):
  x [T, H]; w13 [E, 2I, H] = every expert's [gate | up] rows; w2 [E, H, I];
  topk_weights [T, K] float32; topk_ids [T, K] int32 (an expert per token and slot).
A (token, slot) pair is numbered t * K + k: the flat index into topk_ids.

- `route`: softmax over the experts in float32, the top K, renormalized to sum to 1 or not
  (Mixtral always; Qwen3-MoE when `norm_topk_prob`), as transformers computes it.
- `moe_align_block_size`: the pairs sorted by expert (stable: token order within an expert), each
  expert's run padded to a multiple of the kernel's row block, so that every block of rows belongs
  to one expert. Device-side torch ops on fixed-size outputs, no value read on the host: it runs
  inside a CUDA graph (the decode steps' graphs, backend/worker/cuda_graphs.py).
- `grouped_moe`: gathers each expert's tokens and runs one GEMM per *active* expert (the CPU
  path; the expert weights may be stacked tensors or per-expert linear layers, float or packed).
- `expert_gemm`: rows sorted by expert, each against its own expert's weight: the oracle of the
  CPU's one-call C kernel (kernels/cpu/moe.py), in float64.
- `dense_moe`: every expert on every token, weighted by a [T, E] matrix that is zero off the
  chosen experts. No host read, so it is the references' GPU branch; and the baseline of
  client/tools/benchmarks/moe.py.
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F

from kernels.reference import host_reads_are_free, silu_mul

# Expert weights: stacked [E, N, K] tensors, or one linear layer per expert (CPU: oneDNN-packed or
# packed-quantized modules, backend/models/moe.py).
ExpertWeights = Union[torch.Tensor, Sequence[Callable[[torch.Tensor], torch.Tensor]]]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted pairs take at most: each active expert (at most min(E, pairs) of them) pads
    its run by up to block_m - 1 rows; rounded up to whole blocks. Depends on shapes only."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of topk_ids [T, K] sorted by expert, each expert's run padded to whole blocks of
    block_m rows.

    Returns sorted_ids [P] int32 (pair numbers; T * K marks padding), expert_ids [P / block_m]
    int32 (the expert of each block; -1 past the last used block) and num_padded [1] int32 (the
    rows in use), P = max_padded_pairs(T * K, E, block_m)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    size = max_padded_pairs(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices           # pairs grouped by expert, token order kept
    expert_of = flat[order]
    first = counts.cumsum(0) - counts                       # each expert's first place in `order`
    dest = (ends - padded)[expert_of] + torch.arange(n, device=dev) - first[expert_of]
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(block_starts < ends[-1], expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


def _linear(weights: ExpertWeights) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """expert e, rows [n, K] -> [n, N] in float32 math."""
    if isinstance(weights, torch.Tensor):
        return lambda e, a: F.linear(a.float(), weights[e].float())
    return lambda e, a: weights[e](a)


def _expert_rows(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, e: int) -> Callable:
    gate_up, down = _linear(w13), _linear(w2)

    def run(rows: torch.Tensor) -> torch.Tensor:
        # rounded where the kernel rounds: the activation and each expert's weighted output
        act = silu_mul(gate_up(e, x[rows]).float()).to(x.dtype)
        return down(e, act).float()
    return run


def grouped_moe(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """One GEMM pair per expert that has tokens, on those tokens only; the weighted outputs added
    into each token's row (float32), rounded to x's dtype once. Reads the per-expert counts on the
    host: a CPU path."""
    t, k = topk_ids.shape
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    if t == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=len(w13)).tolist()
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        y = _expert_rows(x, w13, w2, e)(rows) * weights[start:start + n, None]
        out.index_add_(0, rows, y.to(x.dtype).float())
        start += n
    return out.to(x.dtype)


def expert_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [R, K] float32, rows sorted by expert; w [E, N, K] float32 or bfloat16; offsets [E + 1]
    (expert e's rows: offsets[e] .. offsets[e + 1] - 1) -> [R, N] float32: each row's product with
    its expert's weight (bfloat16 ones widened: exact), summed in float64 and rounded once."""
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.float64)
    bounds = offsets.tolist()
    for e in range(w.shape[0]):
        rows = slice(bounds[e], bounds[e + 1])
        out[rows] = x[rows].double() @ w[e].double().T
    return out.float()


def dense_moe(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, each output weighted by the token's routing weight for that
    expert (zero where it was not chosen). No host read of any value."""
    t = topk_ids.shape[0]
    dense = torch.zeros(t, len(w13), dtype=torch.float32, device=x.device)
    dense.scatter_(1, topk_ids.long(), topk_weights.float())
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    every = torch.arange(t, device=x.device)
    for e in range(len(w13)):
        y = _expert_rows(x, w13, w2, e)(every) * dense[:, e:e + 1]
        out += y.to(x.dtype).float()
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' output [T, H]: sum over k of topk_weights[t, k] * expert_k(x[t]), an expert
    being down(silu(gate(x)) * up(x)). Grouped where reading the counts is free (the CPU), dense
    elsewhere (no host read on a GPU)."""
    if host_reads_are_free(topk_ids):
        return grouped_moe(x, w13, w2, topk_weights, topk_ids)
    return dense_moe(x, w13, w2, topk_weights, topk_ids)
