"""CPU speed of the float-weight GEMM (kernels/cpu/float_gemm.py) against oneDNN's, on SmolLM2-135M's
four projection shapes, in one interleaved run (issue 47: where each is faster, docs/performance.md).

    OMP_NUM_THREADS=1 python -m client.tools.benchmarks.float_gemm [--dtypes bfloat16,float32]
        [--rows 1,4,8,32,128,512] [--rounds 7] [--stream]

Per dtype and row count, three ways of one layer's projections (qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576): the C kernel (the build this CPU chooses; INFLIGHT_FLOAT_ISA forces
one), oneDNN on a reordered copy (PackedLinear, what the engine ran before issue 47) and oneDNN on
the same tensor (FloatLinear.onednn, what the engine runs from its ONEDNN_FROM rows on). Every
round times each way back to back in rotating order; the report is each way's fastest round. The
clock is the process's CPU time, which other processes on a shared machine cannot inflate by
preempting it (with one thread: the work done). `--stream`: one row through 30 such layers instead,
so the weights stream from memory as a decode step's do (GB/s of weights read).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from backend.models.float_linear import FloatLinear
from backend.models.packed_linear import PackedLinear
from kernels.cpu import float_gemm, onednn

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of SmolLM2's projections
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def layers(dtype: torch.dtype, count: int) -> list[tuple]:
    out = []
    for k, n in SHAPES * count:
        linear = nn.Linear(k, n, bias=False)
        linear.weight = nn.Parameter(linear.weight.detach().to(dtype), requires_grad=False)
        out.append((FloatLinear(linear), PackedLinear(linear)))
    return out


def time_ways(mods: list[tuple], rows: int, rounds: int, repeats: int) -> list[float]:
    """The fastest round's CPU seconds of each way: C kernel, PackedLinear, oneDNN on the same tensor."""
    ways = [lambda f, p, x: f.kernel.matmul(x), lambda f, p, x: p(x), lambda f, p, x: f.onednn(x)]
    dtype = mods[0][0].weight.dtype
    if (dtype == torch.float16 and not onednn.runs_fp16()) or (dtype == torch.bfloat16 and not onednn.runs_bf16()):
        ways = ways[:2]   # oneDNN has no fp16 GEMM without avx512_fp16 or avx_ne_convert, nor a bf16 one without
        # AVX-512 (an AVX2-only CPU): PackedLinear multiplies a float32 copy, or the bf16 weight widened at each call
    xs = [torch.randn(rows, f.in_features) for f, _ in mods]
    best = [float("inf")] * 3
    for r in range(rounds):
        for w in [(r + i) % len(ways) for i in range(len(ways))]:
            start = time.process_time()
            for _ in range(repeats):
                for (f, p), x in zip(mods, xs):
                    ways[w](f, p, x)
            best[w] = min(best[w], (time.process_time() - start) / repeats)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,4,8,32,128,512")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stream", action="store_true", help="one row through 30 layers (weights from memory)")
    args = parser.parse_args(argv)
    print(f"float GEMM build: {float_gemm.chosen_isa()}; threads: {torch.get_num_threads()}; CPU time, best round")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        if args.stream:
            mods = layers(dtype, 30)
            mb = sum(k * n for k, n in SHAPES) * 30 * dtype.itemsize / 1e6
            c, packed, same = time_ways(mods, 1, args.rounds, 1)
            print(f"{name}: 30 layers, {mb:.0f} MB, 1 row: C {c * 1e3:.2f} ms ({mb / c / 1e3:.1f} GB/s), PackedLinear "
                  f"{packed * 1e3:.2f} ms ({mb / packed / 1e3:.1f} GB/s), oneDNN same tensor {same * 1e3:.2f} ms")
            continue
        mods = layers(dtype, 1)
        for rows in (int(r) for r in args.rows.split(",")):
            c, packed, same = time_ways(mods, rows, args.rounds, max(2, 400 // rows))
            print(f"{name} rows {rows:5d}: C {c * 1e3:8.3f} ms  PackedLinear {packed * 1e3:8.3f} ms  "
                  f"oneDNN same tensor {same * 1e3:8.3f} ms  PackedLinear/C {packed / c:5.2f}")


if __name__ == "__main__":
    main()
