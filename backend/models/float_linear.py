"""Float linear layers on the CPU through the C kernel of kernels/cpu/float_gemm.py (issue 47).

`FloatLinear` holds a float32, bfloat16 or float16 weight as torch does and multiplies float32
activations by it in C: the same kernel the C layer stack (kernels/cpu/decode_stack.py) calls, so
a model with float weights takes that stack too, bit for bit the Python layers' results. Where
oneDNN's GEMM is faster (many rows: a prompt chunk), steps of `onednn_from` rows or more run it
instead, on the same tensor (no reordered copy: the weights' memory does not grow), in both paths
(the stack calls the module back); the thresholds per build and dtype are
`float_onednn_from`'s.

Why not oneDNN for every step: at a decode step's few rows its GEMM on float weights runs well
below the C kernel (1.9-2.6x slower at one row), and the Python around each call costs as much again
(docs/performance.md, "Issue 47: the C layer stack for float weights").

`INFLIGHT_FLOAT_GEMM=onednn` keeps oneDNN's PackedLinears as before (the benchmarks' A/B); the
layers the kernel does not take (K not a multiple of 32, no C compiler) keep them too.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import torch
from torch import nn

from backend.models.packed_linear import MAX_ROWS, PackedLinear, row_bucket

log = logging.getLogger(__name__)


# The rows from which oneDNN's GEMM on a float weight is faster than kernels/cpu/float_gemm.py's by
# 1.1x (cpu_weight_choice.MARGIN), per build and weight dtype, as measured on SmolLM2's four projection
# shapes (docs/performance.md, "Issue 47: the C layer stack for float weights"): the C kernel wins a
# decode step's few rows (1.9-2.6x at one row), oneDNN the prompt chunks'. 0 (the C kernel at every
# row count) where oneDNN has no kernel for the pair: bfloat16 weights without AVX-512, and float16
# (a GGUF F16 file's: torch 2.13's oneDNN refuses an fp16 GEMM without avx512_fp16 or avx_ne_convert,
# measured on the AVX-512 EPYC; torch's own fp16 F.linear ran 4-5x slower than this kernel at 1 to
# 512 rows, docs/performance.md "F16 and BF16 GGUF files kept"). The portable build's 2 was not
# measured: its plain C is several times slower than oneDNN's GEMMs.
ONEDNN_FROM = {
    "avx512_bf16": {torch.float32: 64, torch.bfloat16: 256},
    "avx512": {torch.float32: 64, torch.bfloat16: 256},
    "avx2": {torch.float32: 16},
    "portable": {torch.float32: 2},
}


# Where oneDNN has a faster kernel than the build's table assumes (measured on a Sapphire Rapids
# Xeon, 2026-12-04, one thread, SmolLM2's shapes; docs/performance.md, "Issue 47: the F16 and BF16
# rows"): bfloat16 on AMX tiles passes the C kernel by 1.56x at 16 rows (0.83 vs 1.29 ms) and 7x at
# 512; float16 on AVX512-FP16 by 1.11x at 64 rows and 1.25-1.37x from 128.
ONEDNN_FROM_AMX_BF16 = 16
ONEDNN_FROM_FP16 = 128
# float16 where oneDNN has no fp16 kernel (every CPU without AVX512-FP16 or AVX-NE-CONVERT: the AMD
# EPYC, AVX2 CPUs): the weight is widened to float32 a slice at a time (WIDEN_BYTES, so each slice is
# still in the cache when oneDNN's float32 GEMM reads it) and oneDNN multiplies that. Measured on the
# EPYC, 2 threads, SmolLM2's four projections, against the C kernel (which widens every weight vector
# once per block of rows): the AVX-512 builds 0.65-1.05x at 32 rows, 0.80-1.21x at 64, 1.12-1.60x at
# 128, 1.25-1.89x at 512; the AVX2 build against oneDNN capped at AVX2 0.96-1.18x at 64, 1.09-1.19x at
# 128, 1.24-1.55x at 512 (docs/performance.md, "Issue 47 on the AMD EPYC: a mixture of experts' layer
# in one C call"). The portable build was not measured. Each was measured with oneDNN at least at the
# build's own ISA (WIDENED_NEEDS): a cap below it leaves float16 on the C kernel.
ONEDNN_FROM_F16_WIDENED = 128
WIDENED_NEEDS = {"avx512_bf16": ("AVX512", "AMX"), "avx512": ("AVX512", "AMX"), "avx2": ("AVX2", "AVX512", "AMX")}
WIDEN_BYTES = 8 << 20
# bfloat16 on the AVX2 build (oneDNN's bf16 GEMM needs AVX-512: capped at AVX2 it refuses the
# primitive), the same way: widened a slice at a time (exactly: a 16-bit shift) for oneDNN's float32
# GEMM. Measured on a Sapphire Rapids Xeon, the AVX2 build with oneDNN capped at AVX2, 2 threads,
# SmolLM2's four projections summed, against the C kernel: 0.94x at 64 rows, 1.13x at 128, 1.39x at
# 256, 1.38x at 512 (docs/performance.md, "Issue 47: bfloat16 prompts and float GEMVs on the AVX2
# build").
ONEDNN_FROM_BF16_WIDENED = 128


def widened(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies a weight of ``dtype`` as float32 slices widened from it (it has no
    GEMM of its own for that dtype here): float16 without oneDNN's fp16 kernel, bfloat16 on the AVX2
    build; each only where ONEDNN_MAX_CPU_ISA leaves oneDNN the float kernel's build ISA."""
    from kernels.cpu import float_gemm, onednn
    isa = float_gemm.chosen_isa()
    if isa not in WIDENED_NEEDS or not onednn.max_isa_allows(*WIDENED_NEEDS[isa]):
        return False
    return (dtype == torch.float16 and not onednn.runs_fp16()) or (dtype == torch.bfloat16 and isa == "avx2")


def float_onednn_from(dtype: torch.dtype) -> int:
    """The rows from which float layers of weight ``dtype`` run oneDNN instead of the C kernel on
    this CPU (0: never): INFLIGHT_FLOAT_ONEDNN_FROM (for every dtype oneDNN takes), else
    ONEDNN_FROM for the float kernel's build, lowered where oneDNN runs bfloat16 on AMX tiles, and for
    float16 oneDNN's fp16 kernel where it has one (AVX512-FP16), else its float32 one on the weight
    widened a slice at a time (`widened`: `ONEDNN_FROM_F16_WIDENED`, and bfloat16 on the AVX2 build
    `ONEDNN_FROM_BF16_WIDENED`)."""
    from kernels.cpu import float_gemm, onednn
    isa = float_gemm.chosen_isa()
    wide = widened(dtype)
    own = (dtype == torch.float32 or (dtype == torch.bfloat16 and isa != "avx2" and onednn.runs_bf16())  # its own GEMM
           or (dtype == torch.float16 and onednn.runs_fp16()))
    forced = os.environ.get("INFLIGHT_FLOAT_ONEDNN_FROM")
    if forced is not None:
        if not forced.isdigit():
            raise ValueError(f"INFLIGHT_FLOAT_ONEDNN_FROM={forced!r}; a row count (0: never)")
        return int(forced) if own or wide else 0
    if dtype == torch.float16:   # oneDNN's fp16 GEMM, else its float32 one on the widened weight
        if not (own or wide) or isa not in WIDENED_NEEDS:
            return 0
        return ONEDNN_FROM_FP16 if own else ONEDNN_FROM_F16_WIDENED
    if wide:   # bfloat16 on the AVX2 build
        return ONEDNN_FROM_BF16_WIDENED
    if dtype == torch.bfloat16 and not own:   # no bf16 GEMM of oneDNN's (capped below AVX-512)
        return 0
    if isa.startswith("avx512") and dtype == torch.bfloat16 and onednn.runs_amx_bf16():
        return ONEDNN_FROM_AMX_BF16   # (a forced AVX2 build stands for a CPU without AMX)
    return ONEDNN_FROM[isa].get(dtype, 0)


class FloatLinear(nn.Module):
    def __init__(self, linear: nn.Linear, onednn_from: int = 0):
        """``onednn_from``: steps of this many rows or more run oneDNN's GEMM; 0: never."""
        from kernels.cpu import huge_pages
        from kernels.cpu.float_gemm import CpuFloatWeight
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: a tied lm_head still shares the embedding's
        self.weight.data = huge_pages.place(self.weight.data)  # streamed every step: 2 MB pages
        self.bias = linear.bias
        self.kernel = CpuFloatWeight(self.weight.detach())
        self.onednn_from = onednn_from
        # oneDNN without a GEMM for the weight's dtype: its slices widened to float32 for its float32 one
        self.widen = onednn_from > 0 and widened(self.weight.dtype)

    def float_bias(self) -> Optional[torch.Tensor]:
        return None if self.bias is None else self.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # [..., K] (a vision tower's): the rows flattened
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if self.onednn_from and x.shape[0] >= self.onednn_from:
            out = self.onednn(x.float())
        else:
            out = self.kernel.matmul(x.float(), self.float_bias())
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's GEMM on the weight as it is (x cast to its dtype, as PackedLinear does), in
        slices of at most MAX_ROWS rows, each padded to its row bucket (one primitive per bucket,
        packed_linear.py); the bias added in float32 after. A weight whose dtype oneDNN has no GEMM
        for (`widen`, see `widened`): WIDEN_BYTES of its rows at a time widened to float32 (exactly),
        each slice's output columns from oneDNN's float32 GEMM."""
        weight = self.weight.detach()
        step = max(16, WIDEN_BYTES // (4 * self.in_features)) if self.widen else self.out_features
        slices = []
        for n0 in range(0, self.out_features, step):
            w = weight[n0:n0 + step].float() if self.widen else weight
            for start in range(0, x.shape[0], MAX_ROWS):
                part = x[start:start + MAX_ROWS]
                rows, padded = part.shape[0], row_bucket(part.shape[0])
                if padded != rows:
                    part = torch.nn.functional.pad(part, (0, 0, 0, padded - rows))
                slices.append((start, n0, torch.ops.mkldnn._linear_pointwise(part.to(w.dtype), w, None, "none", [],
                                                                             "")[:rows]))
        if len(slices) == 1:   # one GEMM call: its output as it is (no copy)
            out = slices[0][2]
        else:
            out = torch.empty(x.shape[0], self.out_features, dtype=slices[0][2].dtype)
            for start, n0, part in slices:
                out[start:start + part.shape[0], n0:n0 + part.shape[1]] = part
        out = out.float()
        return out if self.bias is None else out + self.float_bias()

    def extra_repr(self) -> str:
        onednn = f", oneDNN from {self.onednn_from} rows" if self.onednn_from else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{str(self.weight.dtype).removeprefix('torch.')}, C kernel ({self.kernel.isa}){onednn}")


def _kernel_ready() -> bool:
    """Whether FloatLinears are made: not with INFLIGHT_FLOAT_GEMM=onednn, nor without a C compiler."""
    from kernels.cpu import build as cpu_build
    from kernels.cpu import float_gemm
    if os.environ.get("INFLIGHT_FLOAT_GEMM", "auto") == "onednn":
        return False
    try:
        cpu_build.load(float_gemm.NAME, float_gemm.chosen_isa())
        return True
    except cpu_build.CpuKernelUnavailable as exc:
        log.warning("float CPU kernel unavailable, oneDNN GEMMs for every float layer: %s", exc)
        return False


def float_linears(model: nn.Module, onednn_from: Optional[Callable[[torch.dtype], int]] = None) -> int:
    """Replace each nn.Linear whose weight the C kernel takes with a FloatLinear, in place (oneDNN
    from ``onednn_from(weight dtype)`` rows, default float_onednn_from's); returns
    how many (0 with INFLIGHT_FLOAT_GEMM=onednn, or without a C compiler)."""
    from kernels.cpu import float_gemm
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and float_gemm.supports(module.weight)]
    if not targets or not _kernel_ready():
        return 0
    if onednn_from is None:
        onednn_from = float_onednn_from
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FloatLinear(module, onednn_from(module.weight.dtype)))
    return len(targets)


def dequantized_linear(linear: nn.Linear, onednn_from: Callable[[torch.dtype], int] = float_onednn_from) -> nn.Module:
    """What the engine runs a float nn.Linear as on the CPU: a FloatLinear where float_linears
    would make one, else a PackedLinear (backend/models/cpu_weight_choice.py times it)."""
    from kernels.cpu import float_gemm
    if float_gemm.supports(linear.weight) and _kernel_ready():
        return FloatLinear(linear, onednn_from(linear.weight.dtype))
    return PackedLinear(linear)
