"""CPU speed of the packed quantized GEMM (kernels/cpu_quant.py) in two or more of its builds, on the
projections of one SmolLM2-135M layer, in one interleaved run.

    OMP_NUM_THREADS=1 python -m client.tools.cpu_quant_bench [--builds avx2_autovec,avx2]
        [--formats Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K] [--rows 1,64] [--repeats 7] [--json FILE]

Builds are kernels/cpu_build.py ISA_FLAGS keys, forced whatever this CPU would choose (an AVX-512
machine runs the AVX2 build too): by default `avx2_autovec` (the portable C code vectorized by the
compiler for AVX2, what the avx2 build was before its intrinsics) against `avx2`. Each format gets
random weights of the layer's shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; the
K-quants' 256-value blocks fit only down's 1536 inputs, so for them the layer is down alone, as
llama.cpp's K-quant files of this model fall back to other types for the rest). 1 row is a decode
step's GEMV, more rows a batch. The builds' outputs are compared too (the same integer sums:
equal up to float rounding). Each repeat times every build back to back, in alternating order,
and the report is the median per build and the median of the per-repeat ratios to the first build.
The clock is the process's CPU time (every thread's), which other processes on a shared machine
cannot inflate by preempting it; at 2 threads it also counts a thread's wait at the end of a
parallel loop, as the engine pays it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from typing import Optional

import torch

from client.tools.moe_bench import cpu_model, isa
from kernels import cpu_build, cpu_quant
from kernels.quant_bench import random_parts

SMOLLM2_LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def layer_weights(qtype: str, build: str, seed: int) -> dict[str, cpu_quant.CpuQuantWeight]:
    gen = torch.Generator().manual_seed(seed)
    block = 256 if qtype in K_QUANTS else 32
    return {name: cpu_quant.CpuQuantWeight(qtype, random_parts(qtype, n, k, "cpu", gen), isa=build)
            for name, (n, k) in SMOLLM2_LAYER.items() if k % block == 0}


def time_layer(weights: dict, xs: dict, min_time: float) -> float:
    """CPU seconds per pass over the layer's projections (as many passes as fill min_time)."""
    for name, w in weights.items():
        w.matmul(xs[name])  # first call: page the library and the tiles in
    passes, start = 0, time.process_time()
    while True:
        for name, w in weights.items():
            w.matmul(xs[name])
        passes += 1
        spent = time.process_time() - start
        if spent >= min_time:
            return spent / passes


def measure(qtype: str, rows: int, builds: list[str], repeats: int, min_time: float, seed: int = 0) -> dict:
    layers = {b: layer_weights(qtype, b, seed) for b in builds}  # the same random weights in each build
    gen = torch.Generator().manual_seed(seed + 1)
    xs = {name: torch.randn(rows, w.in_features, generator=gen) for name, w in layers[builds[0]].items()}
    times: dict[str, list[float]] = {b: [] for b in builds}
    for r in range(repeats):
        for b in (builds if r % 2 == 0 else builds[::-1]):
            times[b].append(time_layer(layers[b], xs, min_time))
    first = builds[0]
    outputs = {b: torch.cat([w.matmul(xs[name]).flatten() for name, w in layers[b].items()]) for b in builds}
    return dict(qtype=qtype, rows=rows, projections=list(layers[first]),
                max_abs_difference=max(float((outputs[b] - outputs[first]).abs().max()) for b in builds),
                us={b: statistics.median(t) * 1e6 for b, t in times.items()},
                speedup={b: statistics.median(a / c for a, c in zip(times[first], times[b])) for b in builds[1:]})


def _list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.cpu_quant_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", type=_list, default=["avx2_autovec", "avx2"],
                   help="kernels/cpu_build.py ISA_FLAGS keys, the first the baseline (default %(default)s)")
    p.add_argument("--formats", type=_list, default=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
    p.add_argument("--rows", type=lambda t: [int(v) for v in _list(t)], default=[1, 64])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-time", type=float, default=0.05, help="CPU seconds per timing (default %(default)s)")
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    args = p.parse_args(argv)
    for b in args.builds:
        if b not in cpu_build.ISA_FLAGS:
            p.error(f"--builds: {b!r} is not one of {', '.join(cpu_build.ISA_FLAGS)}")
    if min(args.rows, default=0) < 1:
        p.error(f"--rows: positive integers; got {args.rows}")
    for q in args.formats:
        if q not in cpu_quant.TYPE_IDS:
            p.error(f"--formats: {q!r} is not one of {', '.join(cpu_quant.TYPE_IDS)}")
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  cpu=cpu_model(), isa=isa(), threads=torch.get_num_threads(), builds=args.builds,
                  repeats=args.repeats, clock="process_time", rows=[])
    print(f"{result['cpu']} ({result['isa']}), {result['threads']} threads, {result['date']}; builds "
          f"{', '.join(args.builds)} (forced); CPU microseconds per layer, median of {args.repeats}")
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
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
