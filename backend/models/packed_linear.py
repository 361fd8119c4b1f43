"""Linear layers with their weights reordered once for oneDNN, for the CPU engine.

torch's CPU F.linear calls MKL's sgemm, which on AMD processors takes a slower path than the
hardware allows; oneDNN picks its kernel from the CPU's feature flags (AVX-512 here) and, given
a weight already reordered into its blocked layout, does no per-call packing. On this machine
(2-core AMD EPYC, SmolLM2's five projection shapes, one thread) that was 2.6x faster at 16 rows
and 1.8x at 64 (docs/performance.md). The reordered weight replaces the dense one, so memory does
not grow (but for a tied lm_head, whose dense copy the embedding still needs).

oneDNN builds (and caches) one primitive per input shape, about 0.6 MB each (3.4 MB past 256
rows), and keeps up to a thousand: fed every row count from 1 to 2,048 as they come, the process
grew by hundreds of MB (the soak test caught it). So the rows go in fixed buckets, 44 at most per
weight shape whatever the traffic: up to 8 rows, 4, 6 or 8; up to 64, the next multiple of 4; up
to 256, of 16; up to 4,096 (a prefill chunk), of 256; more, in slices of 4,096. Past 8 rows a
step's GEMMs cost ~1.6 ms a row on SmolLM2 (2 threads), padding rows included, so the steps are
fine where decode batches live; below, the cost is reading the weights, and oneDNN's kernels for 4
to 6 rows read them faster than its 1-, 2- or 8-row ones (20 against 24-28 ms a step, in one
run). Slicing chunks into 256-row GEMMs instead cost the copy of every slice into the output and
~4% of GEMM speed. The runner pads a whole step to its bucket once (`padded_rows`), so the
layers' GEMMs pad nothing.

The batch-size hint only steers the reorder's blocking; any number of rows works. Results differ
from MKL's by float summation order (~1e-5 relative), as any two GEMM libraries do.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu import onednn

BATCH_HINT = 64  # rows the blocked layout is tuned for: in-flight decode batches sit near it
MAX_ROWS = 4096  # rows per GEMM call; longer inputs go in slices of this many


def row_bucket(rows: int) -> int:
    """The row count a GEMM of `rows` rows (1 to MAX_ROWS) is padded to."""
    if rows <= 8:
        return 4 if rows <= 4 else 6 if rows <= 6 else 8
    step = 4 if rows <= 64 else 16 if rows <= 256 else 256
    return -(-rows // step) * step


def padded_rows(rows: int) -> int:
    """The rows a step of `rows` tokens is padded to so that every GEMM slice is a bucket."""
    whole, rest = divmod(rows, MAX_ROWS)
    return whole * MAX_ROWS + (row_bucket(rest) if rest else 0)


# float16 weights are reordered from a float32 copy: oneDNN's fp16 GEMM "needs the cpu support
# avx_ne_convert or avx512_fp16" (torch 2.13), which the AVX-512 EPYC measured here lacks, and
# torch's own fp16 F.linear ran 4-5x slower than float_gemm.c (docs/performance.md, issue 47's F16
# rows). float_gemm.c reads them as they are: this is the fallback where it is not used.
# bfloat16 weights where oneDNN has no bf16 GEMM (an AVX2-only CPU: its reorder "needs the cpu
# support avx_ne_convert or avx512bw, avx512vl and avx512dq"; kernels/cpu/onednn.py's runs_bf16)
# stay bfloat16 in memory and are widened to float32 at each call (exact: a 16-bit shift) for
# oneDNN's float32 GEMM on the plain weight: this path only takes the layers float_gemm.c does not.
PACKABLE = (torch.float32, torch.bfloat16, torch.float16)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if weight.dtype == torch.float16:
            weight = weight.float()
        self.widen = weight.dtype == torch.bfloat16 and not onednn.runs_bf16()
        if self.widen:  # kept as it is (bfloat16), multiplied as float32
            self.dtype, self.packed = torch.float32, weight.contiguous()
        else:  # bf16 weights: bf16 GEMMs on inputs cast to bf16 (AVX512_BF16)
            self.dtype = weight.dtype
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()
        if self.widen and self.bias is not None:
            self.bias = self.bias.float()

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
        weight = self.packed.float() if self.widen else self.packed
        if x.dtype == self.dtype:
            out = torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")
        else:  # float32 activations, bf16 weights: the bias is added in float32 after
            out = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), weight, None, "none", [], "")
            out = out.to(x.dtype) if self.bias is None else out.to(x.dtype) + self.bias.to(x.dtype)
        return out if padded == rows else out[:rows]

    def extra_repr(self) -> str:
        widened = ", bfloat16 widened at each call" if self.widen else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn{widened}"


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
