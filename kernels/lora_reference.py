"""Segmented LoRA products (punica's SGMV, vLLM's lora shrink/expand): the torch reference, which is
also the CPU engine's path. Nothing here imports triton.

A step's rows are grouped by adapter into segments (contiguous row ranges, backend/worker/lora/segments.py);
each resident adapter has a slot in two weight banks per fused projection:
  a_bank [slots, shards * R, K]  lora_A of each shard (q, k, v / gate, up / one), rank padded to R
  b_bank [slots, N, R]           lora_B x scaling, the shards' output rows one after another
shrink:  y[rows, i*R:(i+1)*R] = x[rows] @ a_bank[slot, i*R:(i+1)*R].T      for every shard i
expand:  out[rows, off_i:off_i+1] += y[rows, i*R:(i+1)*R] @ b_bank[slot, off_i:off_i+1].T
where (off_i, off_i+1) are the shard's output columns (`shard_bounds`). The expand adds into the
base GEMM's output in place, whatever computed it (float, packed or quantized weights): the
adapter's weights are never merged into the base ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class Segments:
    """One projection's adapter segments in a step.
    runs: (first row, end row, slot) per segment, on the host (what the reference loops over);
    starts/lens/slots: the same as int32 device tensors, padded with slot -1 (what the Triton
    kernels read, so a launch needs no host value but `max_len`); None on the CPU path.
    max_len: a bound on any segment's rows (the kernels' grid)."""
    runs: list[tuple[int, int, int]]
    starts: Optional[torch.Tensor] = None
    lens: Optional[torch.Tensor] = None
    slots: Optional[torch.Tensor] = None
    max_len: int = 0


def lora_shrink(x: torch.Tensor, a_bank: torch.Tensor, segments: Segments) -> torch.Tensor:
    """x [T, K], a_bank [S, shards*R, K] -> y [T, shards*R] float32; rows outside every segment
    are left unwritten (the expand never reads them)."""
    y = torch.empty((x.shape[0], a_bank.shape[1]), dtype=torch.float32, device=x.device)
    for start, end, slot in segments.runs:
        a = a_bank[slot]
        if x.dtype == torch.float32 and a.dtype == torch.float32:
            torch.mm(x[start:end], a.t(), out=y[start:end])
        else:
            y[start:end] = x[start:end].float() @ a.float().t()
    return y


def lora_expand(y: torch.Tensor, b_bank: torch.Tensor, shard_bounds: Sequence[int], segments: Segments,
                out: torch.Tensor) -> torch.Tensor:
    """out [T, N] += each shard's y slice @ its lora_B rows, per segment; returns out."""
    rank = b_bank.shape[2]
    for start, end, slot in segments.runs:
        for i in range(len(shard_bounds) - 1):
            lo, hi = shard_bounds[i], shard_bounds[i + 1]
            part = y[start:end, i * rank:(i + 1) * rank]
            b = b_bank[slot, lo:hi]
            if out.dtype == torch.float32 and b.dtype == torch.float32:
                out[start:end, lo:hi].addmm_(part, b.t())
            else:
                out[start:end, lo:hi] += (part @ b.float().t()).to(out.dtype)
    return out


def lora_add(out: torch.Tensor, x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
             shard_bounds: Sequence[int], segments: Segments) -> torch.Tensor:
    """out += the LoRA delta of every segment (shrink then expand); returns out."""
    if not segments.runs:
        return out
    return lora_expand(lora_shrink(x, a_bank, segments), b_bank, shard_bounds, segments, out)
