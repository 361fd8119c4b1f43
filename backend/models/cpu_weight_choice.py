"""quantization=auto on a packed GGUF checkpoint on the CPU: keep the weights packed (the C integer
kernels, kernels/cpu/quant.py) or dequantize them at load (oneDNN GEMMs in the engine's dtype, as
quantization=none), whichever is faster on this CPU.

Where the AVX512-VNNI build runs, packed is faster for every format and batch size that matters
(1.2-11x float32's oneDNN GEMMs with AVX-512, docs/performance.md), so nothing is measured. Elsewhere
(the avx_vnni, avx2 and portable builds, or no C compiler at all) the answer depends on the format and
the CPU: the AVX2 kernels win a GEMV by 8-14x but only tie float32 at 64 rows for Q8_0 and the
K-quants, and the portable C build is 2-4x slower than float32. So a short measurement decides
(~1 s): the GEMMs of the model's own first layers (as many as make MEASURED_BYTES in float32, so
that the weights stream from memory as a decode step's do instead of sitting in the cache) and of
its lm_head when that is packed, each matrix cut to at most MAX_MEASURED_OUT output rows and its
time scaled back up, at MEASURED_ROWS rows (a decode step of one stream and of a batch), both ways,
scaled to a whole step. Dequantized wins only when it is faster by MARGIN on the geometric mean over
the row counts (the measurement is short, and dequantized weights take 4-8x the memory). It is
skipped, keeping them packed, when the dequantized weights would take more than half the memory
available now, and with tensor parallelism (each rank loads its own shard: measured apart, ranks
could choose differently). On SmolLM2 Q4_1 these estimates came within 10-25% of the engine's own decode steps
with either build (docs/performance.md).

quantization=gguf forces packed and quantization=none dequantized; the choice and its numbers go to
one log line. `choose` takes the measurement as a function, so tests decide what it returns.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from backend.models.float_linear import dequantized_linear
from backend.models.quant_linear import QuantLinear, concat_parts, fused_module_name
from kernels.quant_formats import logical_shape
from kernels.quant_reference import dequantize

log = logging.getLogger(__name__)
FAST_BUILDS = ("amx_int8", "avx512_vnni")  # packed known faster: nothing to measure
MEASURED_ROWS = (1, 16)
MARGIN = 1.1
MAX_MEASURED_OUT = 2048  # output rows of one measured matrix (a 7B model's 14336-row MLP: a slice)
# Weights measured, in float32 bytes: a decode step streams every weight from memory once, so one
# layer's, read again and again from the cache, would flatter the 4-8x larger dequantized ones.
MEASURED_BYTES = 128 * 2**20
REPEATS = 5  # timed rounds per row count; the fastest counts (other processes only add time)
BUDGET_S = 1.0  # wall seconds of timed rounds, after at least two per row count


@dataclass(frozen=True)
class StepTimes:
    """Estimated GEMM seconds (CPU time) of a step of ``rows`` rows, packed and dequantized."""
    rows: int
    packed_s: float
    dequantized_s: float


@dataclass(frozen=True)
class CpuWeightChoice:
    quantization: str  # gguf: kept packed | none: dequantized
    reason: str
    times: tuple[StepTimes, ...] = ()


def choose(isa: Optional[str], measure: Callable[[], Sequence[StepTimes]], dequantized_bytes: int,
           available_bytes: Optional[int]) -> CpuWeightChoice:
    """Packed or dequantized for the quantized-GEMM build ``isa`` (None: no C kernel); ``measure``
    runs only when the answer is not known without it."""
    if isa in FAST_BUILDS:
        return CpuWeightChoice("gguf", f"the {isa} kernel is faster than float GEMMs on every format")
    if available_bytes is not None and 2 * dequantized_bytes > available_bytes:
        return CpuWeightChoice("gguf", f"dequantized weights ({dequantized_bytes / 1e9:.1f} GB) would take more "
                                       f"than half the memory available ({available_bytes / 1e9:.1f} GB)")
    times = tuple(measure())
    if not times:
        return CpuWeightChoice("gguf", "no packed projection to measure")
    ratio = math.exp(sum(math.log(t.dequantized_s / t.packed_s) for t in times) / len(times))
    numbers = "; ".join(f"{t.rows} row{'s' * (t.rows > 1)}: packed {t.packed_s * 1e3:.2f} ms, "
                        f"dequantized {t.dequantized_s * 1e3:.2f} ms" for t in times)
    build = f"the {isa} kernel" if isa else "the torch reference (no C kernel)"
    winner = "gguf" if ratio * MARGIN >= 1.0 else "none"
    verdict = "packed" if winner == "gguf" else "dequantized"
    return CpuWeightChoice(winner, f"{build}, measured GEMM time of a step ({numbers}): dequantized/packed "
                                   f"{ratio:.2f}x, {verdict} chosen", times)


# -- the measurement ------------------------------------------------------------------------------
def measured_matrices(items: Sequence[tuple[str, object]], layers: int, tie_word_embeddings: bool) -> list[tuple[str, dict, float]]:
    """(qtype, arrays cut to MAX_MEASURED_OUT rows, how many such matrices a step multiplies by) of
    the first layers' packed projections, fused as the engine fuses them, as many layers as make
    MEASURED_BYTES of float32 (or all), and of the packed lm_head (a tied one is the embedding's
    table, backend/models/weights.py); ``items``: the checkpoint's weights as weights.py splits them."""
    packed = {name: item for name, item in items if isinstance(item, tuple) and ".experts." not in name}
    tied = tie_word_embeddings or not any(name == "lm_head.weight" for name, _ in items)
    head = "lm_head" if "lm_head" in packed else "model.embed_tokens" if tied else None
    measured, size = [], 0
    for layer in range(layers):
        groups: dict[str, list[str]] = {}
        for name in sorted(n for n in packed if n.startswith(f"model.layers.{layer}.")):
            groups.setdefault(fused_module_name(name) or name, []).append(name)
        measured.append([m for members in groups.values() for m in _cut(packed, members)])
        size += sum(4 * a["qweight"].shape[0] * logical_shape(q, a)[1] for q, a, _ in measured[-1])
        if size >= MEASURED_BYTES:
            break
    step = layers / len(measured) if measured else 0  # each measured layer stands for this many
    matrices = [(q, a, scale * step) for layer in measured for q, a, scale in layer]
    return matrices + (_cut(packed, [head]) if head in packed else [])


def _cut(packed: dict, members: list[str]) -> list[tuple[str, dict, float]]:
    """A fused projection's GEMMs (mixed types: one per part, as ConcatLinear), each cut to
    MAX_MEASURED_OUT rows, with the factor from the cut's time to the whole matrix's."""
    types = {packed[m][0] for m in members}
    parts = [packed[m] for m in members] if len(types) > 1 else \
        [(types.pop(), concat_parts([packed[m][1] for m in members]))]
    out = []
    for qtype, arrays in parts:
        n = arrays["qweight"].shape[0]
        cut = min(n, MAX_MEASURED_OUT)
        out.append((qtype, {k: v[:cut].contiguous() for k, v in arrays.items()}, n / cut))
    return out


def measure_steps(matrices: Sequence[tuple[str, dict, float]], dtype: torch.dtype,
                  rows: Sequence[int] = MEASURED_ROWS) -> list[StepTimes]:
    """Time the matrices packed (QuantLinear) and dequantized (in ``dtype``, as quantization=none runs
    them: backend/models/float_linear.py, else a PackedLinear): the fastest of up to REPEATS rounds of
    the process's CPU time, each matrix's time multiplied by its count in a step."""
    variants = []
    for qtype, arrays, count in matrices:
        weight = dequantize(qtype, arrays).to(dtype)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        variants.append((QuantLinear(qtype, arrays), dequantized_linear(linear), count))
    gen = torch.Generator().manual_seed(0)
    started, out = time.monotonic(), []
    for r in rows if variants else ():
        xs = [torch.randn(r, v[1].in_features, generator=gen) for v in variants]
        best = [math.inf, math.inf]
        for round_ in range(REPEATS + 1):  # round 0 warms up (oneDNN builds its primitives)
            for way in ((0, 1) if round_ % 2 else (1, 0)):  # alternating order
                total = 0.0
                for v, x in zip(variants, xs):
                    t = time.process_time()
                    v[way](x)
                    total += (time.process_time() - t) * v[2]
                if round_:
                    best[way] = min(best[way], total)
            if round_ >= 2 and time.monotonic() - started > BUDGET_S:
                break
        out.append(StepTimes(r, best[0], best[1]))
    return out


def choose_for_checkpoint(items: Sequence[tuple[str, object]], model_cfg, dtype: torch.dtype,
                          dequantized_bytes: int) -> CpuWeightChoice:
    """`choose` for a packed checkpoint's weights (backend/models/weights.py splits them) on this
    CPU, measuring its own matrices; logs the choice."""
    import psutil

    from kernels.cpu import quant as cpu_quant
    layers, tied = model_cfg.num_layers, model_cfg.tie_word_embeddings
    choice = choose(cpu_quant.chosen_isa(), lambda: measure_steps(measured_matrices(items, layers, tied), dtype),
                    dequantized_bytes, psutil.virtual_memory().available)
    way = "packed GGUF weights" if choice.quantization == "gguf" else f"dequantized to {str(dtype).removeprefix('torch.')}"
    log.info("quantization=auto on the CPU: %s (%s; quantization=gguf or none forces either)", way, choice.reason)
    return choice
