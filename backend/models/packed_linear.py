"""Linear layers with their weights reordered once for oneDNN, for the CPU engine.

torch's CPU F.linear calls MKL's sgemm, which on AMD processors takes a slower path than the
hardware allows; oneDNN picks its kernel from the CPU's feature flags (AVX-512 here) and, given
a weight already reordered into its blocked layout, does no per-call packing. On this machine
(2-core AMD EPYC, SmolLM2's five projection shapes, one thread) that was 2.6x faster at 16 rows
and 1.8x at 64 (docs/performance.md). The reordered weight replaces the dense one, so memory does
not grow (but for a tied lm_head, whose dense copy the embedding still needs).

oneDNN builds (and caches) one primitive per input shape, about 0.65 MB each, and keeps up to a
thousand: fed every row count from 1 to 2,048 as they come, the process grew by hundreds of MB
(the soak test caught it). So the rows go in fixed buckets: one row alone; up to 64 rows, the next
multiple of 8; up to 256, the next multiple of 32; up to 4,096 (a prefill chunk), the next
multiple of 256; more, in slices of 4,096. That is 30 shapes per weight shape at most, whatever
the traffic. A padded row costs little: a small batch is bound by reading the weights, and a
chunk pads by fewer than 256 rows (at most 12.5% of 2,048). Slicing chunks into 256-row GEMMs
instead cost the copy of every slice into the output and ~4% of GEMM speed.

The batch-size hint only steers the reorder's blocking; any number of rows works. Results differ
from MKL's by float summation order (~1e-5 relative), as any two GEMM libraries do.
"""
from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 64  # rows the blocked layout is tuned for: in-flight decode batches sit near it
MAX_ROWS = 4096  # rows per GEMM call; longer inputs go in slices of this many


def row_bucket(rows: int) -> int:
    """The row count a GEMM of `rows` rows (at most MAX_ROWS) is padded to. One row stays one
    (a lone decode, where oneDNN's matrix-vector kernel beats an 8-row GEMM)."""
    if rows == 1:
        return 1
    step = 8 if rows <= 64 else 32 if rows <= 256 else 256
    return -(-rows // step) * step


PACKABLE = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= MAX_ROWS:
            return self._gemm(x)
        out = x.new_empty(rows, self.out_features)
        for start in range(0, rows, MAX_ROWS):
            out[start:start + MAX_ROWS] = self._gemm(x[start:start + MAX_ROWS])
        return out

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padded = row_bucket(rows)
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if padded == rows else out[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in PACKABLE and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module, batch_hint: int = BATCH_HINT) -> int:
    """Replace every nn.Linear in the model with a PackedLinear, in place; returns how many."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module, batch_hint))
    return len(targets)
