"""CPU speed of the packed quantized GEMM (kernels/cpu/quant.py) in two or more of its builds, on the
projections of one SmolLM2-135M layer, in one interleaved run.

    OMP_NUM_THREADS=1 python -m client.tools.benchmarks.cpu_quant [--builds avx2_autovec,avx2]
        [--formats Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K] [--rows 1,16,64] [--repeats 7] [--json FILE]

Builds are kernels/cpu/build.py ISA_FLAGS keys, forced whatever this CPU would choose (an AVX-512
machine runs the AVX2 build too): by default `avx2_autovec` (the portable C code vectorized by the
compiler for AVX2, what the avx2 build was before its intrinsics) against `avx2`; `float32` adds
the same weights dequantized through oneDNN (`quantization=none`; ONEDNN_MAX_CPU_ISA=AVX2 in the
environment makes it what an AVX2-only CPU runs). Each format gets
random weights of the layer's shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; the
K-quants' 256-value blocks fit only down's 1536 inputs, so for them the layer is down alone, as
llama.cpp's K-quant files of this model fall back to other types for the rest). 1 row is a decode
step's GEMV, more rows a batch. The builds' outputs are compared too (the same integer sums:
equal up to float rounding). Each repeat times every build back to back, in alternating order,
and the report is the median per build and the median of the per-repeat ratios to the first build.
The clock is the process's CPU time (every thread's), which other processes on a shared machine
cannot inflate by preempting it; wall time goes to --json beside it. With several threads the
CPU time also counts a thread's spinning wait at the end of each parallel loop (the default
OpenMP policy, as the engine runs): about threads x wall on an idle machine, more where a partner
thread was preempted. OMP_WAIT_POLICY=PASSIVE removes the spinning but makes every call pay a
futex wake-up (~50 us here), which swamps a one-row GEMV.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from backend.models.packed_linear import PackedLinear
from client.tools.benchmarks.moe import cpu_model, isa
from kernels.cpu import build as cpu_build
from kernels.cpu import quant as cpu_quant
from kernels.gpu.quant_bench import random_parts
from kernels.quant_reference import dequantize

SMOLLM2_LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
FLOAT32 = "float32"  # not a build: the dequantized weights through oneDNN, for comparison


class Float32Weight:
    """The same matrix dequantized, as `quantization=none` runs it: oneDNN's float32 GEMM."""

    def __init__(self, qtype: str, parts: dict):
        weight = dequantize(qtype, parts)
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = weight
        self.gemm, self.in_features = PackedLinear(linear), weight.shape[1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


def layer_weights(qtype: str, build: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    block = 256 if qtype in K_QUANTS else 32
    make = (lambda parts: Float32Weight(qtype, parts)) if build == FLOAT32 else \
        (lambda parts: cpu_quant.CpuQuantWeight(qtype, parts, isa=build))
    return {name: make(random_parts(qtype, n, k, "cpu", gen))
            for name, (n, k) in SMOLLM2_LAYER.items() if k % block == 0}


def time_layer(weights: dict, xs: dict, min_time: float) -> tuple[float, float]:
    """CPU and wall seconds per pass over the layer's projections (as many passes as fill min_time)."""
    for name, w in weights.items():
        w.matmul(xs[name])  # first call: page the library and the tiles in
    passes, start, wall = 0, time.process_time(), time.perf_counter()
    while True:
        for name, w in weights.items():
            w.matmul(xs[name])
        passes += 1
        spent = time.process_time() - start
        if spent >= min_time:
            return spent / passes, (time.perf_counter() - wall) / passes


def measure(qtype: str, rows: int, builds: list[str], repeats: int, min_time: float, seed: int = 0) -> dict:
    layers = {b: layer_weights(qtype, b, seed) for b in builds}  # the same random weights in each build
    gen = torch.Generator().manual_seed(seed + 1)
    xs = {name: torch.randn(rows, w.in_features, generator=gen) for name, w in layers[builds[0]].items()}
    times: dict[str, list[float]] = {b: [] for b in builds}
    walls: dict[str, list[float]] = {b: [] for b in builds}
    for r in range(repeats):
        for b in (builds if r % 2 == 0 else builds[::-1]):
            cpu, wall = time_layer(layers[b], xs, min_time)
            times[b].append(cpu)
            walls[b].append(wall)
    first = builds[0]
    outputs = {b: torch.cat([w.matmul(xs[name]).flatten() for name, w in layers[b].items()]) for b in builds}
    return dict(qtype=qtype, rows=rows, projections=list(layers[first]),
                max_abs_difference=max(float((outputs[b] - outputs[first]).abs().max()) for b in builds
                                       if b != FLOAT32),
                us={b: statistics.median(t) * 1e6 for b, t in times.items()},
                wall_us={b: statistics.median(t) * 1e6 for b, t in walls.items()},
                speedup={b: statistics.median(a / c for a, c in zip(times[first], times[b])) for b in builds[1:]})


def _list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.cpu_quant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", type=_list, default=["avx2_autovec", "avx2"],
                   help="kernels/cpu/build.py ISA_FLAGS keys, the first the baseline (default %(default)s)")
    p.add_argument("--formats", type=_list, default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
    p.add_argument("--rows", type=lambda t: [int(v) for v in _list(t)], default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.05, help="CPU seconds per timing (default %(default)s)")
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    args = p.parse_args(argv)
    for b in args.builds:
        if b not in cpu_build.ISA_FLAGS and b != FLOAT32:
            p.error(f"--builds: {b!r} is not one of {', '.join(cpu_build.ISA_FLAGS)}, {FLOAT32}")
    if min(args.rows, default=0) < 1:
        p.error(f"--rows: positive integers; got {args.rows}")
    for q in args.formats:
        if q not in cpu_quant.TYPE_IDS:
            p.error(f"--formats: {q!r} is not one of {', '.join(cpu_quant.TYPE_IDS)}")
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  cpu=cpu_model(), isa=isa(), threads=torch.get_num_threads(), builds=args.builds,
                  repeats=args.repeats, clock="process_time",
                  omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),
                  onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA", "any"), rows=[])
    print(f"{result['cpu']} ({result['isa']}), {result['threads']} threads (OMP_WAIT_POLICY "
          f"{result['omp_wait_policy']}), {result['date']}; builds {', '.join(args.builds)} (forced; oneDNN "
          f"up to {result['onednn_max_isa']}); CPU microseconds per layer, median of {args.repeats}")
    print(f"{'format':7} {'rows':>5} {'projections':24} " + " ".join(f"{b:>13}" for b in args.builds)
          + "".join(f" {b + ' speedup':>16}" for b in args.builds[1:]))
    for qtype in args.formats:
        for rows in args.rows:
            row = measure(qtype, rows, args.builds, args.repeats, args.min_time)
            result["rows"].append(row)
            print(f"{qtype:7} {rows:>5} {','.join(row['projections']):24} "
                  + " ".join(f"{row['us'][b]:>13.1f}" for b in args.builds)
                  + "".join(f" {row['speedup'][b]:>15.2f}x" for b in args.builds[1:]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
