"""The quantized GEMMs' part of the GPU check (`inflight gpu-check`, through `python -m client.tools.benchmarks.kernel_bench`):

- `checks`: every quantized format through `quant_linear` against `linear_reference` on the GPU,
  in bfloat16 (which the CPU interpreter cannot check) for every qtype, float16 for a few, and FP8
  (which the interpreter cannot run at all); decode (split K as chosen for the GPU) and prefill
  batches, N not a multiple of the tiles (but of 8, as AWQ packs 8 outputs a word). Pass: every output within `error_bound`.
- `bench`: Llama-3-8B-shaped projections (qkv, o, gate_up, down) at M = 1, 16, 64 and a prefill
  of 512 rows, for a representative qtype per family, in microseconds and as a share of the
  bandwidth floor (the bytes of the quantized weights, activations and output over the measured
  copy bandwidth), beside torch's bf16 GEMM on the same shape (what the quantization saves).

About 25 kernel variants compile (the first call of each) and the timings take seconds: well
under a minute on an H100/H200. `--dry-run-cpu` runs the same code under the interpreter, tiny.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from kernels.gpu.quant_dispatch import QTYPES, quant_launches, quant_linear
from kernels.quant_formats import dequantize, linear_reference, pack_awq, quantize_fp8

LLAMA3_8B_PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BENCH_QTYPES = ("Q4_0", "Q4_K", "Q6_K", "Q8_0", "FP8", "AWQ")
BENCH_ROWS = (1, 16, 64, 512)
FULL = dict(check_shape=(296, 1536), check_rows=(1, 5, 70), projections=LLAMA3_8B_PROJECTIONS,
            rows=BENCH_ROWS, qtypes=BENCH_QTYPES, dtype=torch.bfloat16,
            check_dtypes={torch.bfloat16: QTYPES, torch.float16: ("Q4_K", "Q8_0", "FP8", "AWQ")})
DRY = dict(check_shape=(40, 256), check_rows=(5,), projections={"o": (72, 256)}, rows=(1, 70),
           qtypes=("Q4_K", "AWQ"), dtype=torch.float16,     # no FP8 and no bf16 under the interpreter
           check_dtypes={torch.float16: tuple(q for q in QTYPES if q != "FP8")})
# Unit roundoff of each dtype: the kernels round every dequantized weight to x's dtype (u) and the
# output (another u), and accumulate in float32.
UNIT = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, the most a quantized GEMM may differ from `linear_reference`: 2u sum_k |x_k w_nk|
    (u of x's dtype; float32: 1e-6 for the accumulation order), w the float32 weights [N, K]."""
    u = 1e-6 if x.dtype == torch.float32 else 2 * UNIT[x.dtype]
    return u * (x.float().abs() @ w.abs().T) + 1e-30


def compare(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, qtype: str,
            parts: Mapping[str, torch.Tensor]) -> tuple[bool, float, float]:
    """(ok, max |error|, worst error / bound); NaN (an unwritten output) fails."""
    bound = error_bound(x, dequantize(qtype, parts).to(x.device))
    err = (got.float() - want.float()).abs()
    ratio = float((err / bound).max()) if err.numel() else 0.0
    ok = got.shape == want.shape and not bool(torch.isnan(got).any()) and ratio <= 1.0
    return ok, float(err.max()) if err.numel() else 0.0, ratio


def random_parts(qtype: str, n: int, k: int, device: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A random [N, K] matrix in the qtype's arrays, made on the device (fast at 8B shapes)."""
    def ints(cols, low, high, dtype):
        return torch.randint(low, high, (n, cols), device=device, generator=gen, dtype=torch.int64).to(dtype)

    def halves(cols, rows=n):
        return (torch.rand(rows, cols, device=device, generator=gen) * 0.02 + 1e-3).half()

    if qtype == "FP8":
        return quantize_fp8(torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16))
    if qtype == "INT8":
        return {"qweight": ints(k, -127, 128, torch.int8), "scales": halves(1).float()}
    if qtype == "Q8_0":
        return {"qweight": ints(k, -127, 128, torch.int8), "scales": halves(k // 32)}
    if qtype == "AWQ":
        codes = torch.randint(0, 16, (k + k // 128, n), device=device, generator=gen)
        return {"qweight": pack_awq(codes[:k]), "qzeros": pack_awq(codes[k:]), "scales": halves(n, k // 128)}
    kq = qtype.endswith("_K")
    parts = {"qweight": ints(k // 2, 0, 256, torch.uint8), "scales": halves(k // (256 if kq else 32))}
    if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        parts["mins"] = -halves(parts["scales"].shape[1])
    if qtype in ("Q5_0", "Q5_1", "Q5_K", "Q6_K"):
        parts["qhigh"] = ints(k // (4 if qtype == "Q6_K" else 8), 0, 256, torch.uint8)
    if qtype == "Q6_K":
        parts["sub_scales"] = ints(k // 16, -128, 128, torch.int8)
    elif kq:
        parts["sub_scales"], parts["sub_mins"] = ints(k // 32, 0, 64, torch.uint8), ints(k // 32, 0, 64, torch.uint8)
    return parts


def checks(device: str, dry: bool = False) -> list[dict]:
    """Each qtype x dtype x batch through quant_linear against the reference; rows shaped like
    client.tools.benchmarks.kernel_bench's checks (kernel, dtype, detail, max_abs_err, ok) plus the error / bound ratio."""
    p = DRY if dry else FULL
    n, k = p["check_shape"]
    gen = torch.Generator(device=device).manual_seed(23)
    rows = []
    for dtype, qtypes in p["check_dtypes"].items():
        for qtype in qtypes:
            parts = random_parts(qtype, n, k, device, gen)
            bias = torch.randn(n, device=device, generator=gen)
            for m in p["check_rows"]:
                x = torch.randn(m, k, device=device, generator=gen).to(dtype)
                got = quant_linear(x, qtype, parts, bias)
                ok, err, ratio = compare(got, linear_reference(x, qtype, parts, bias), x, qtype, parts)
                rows.append(dict(kernel="quant_linear", dtype=str(dtype).replace("torch.", ""),
                                 detail=f"{qtype} M={m} N={n} K={k} +bias", max_abs_err=err,
                                 bound_ratio=ratio, ok=ok))
    return rows


def bench(timer: Callable, copy_gbs: float, iters: int, device: str, dry: bool = False,
          log: Optional[Callable[[str], None]] = print) -> list[dict]:
    """us per call and % of the bandwidth floor for each projection x qtype x M, and torch's GEMM
    on the dense weight of the same shape (dense_us)."""
    p = DRY if dry else FULL
    dtype = p["dtype"]
    gen = torch.Generator(device=device).manual_seed(8)
    rows = []
    for proj, (n, k) in p["projections"].items():
        dense = torch.randn(n, k, device=device, generator=gen).to(dtype)
        weights = {q: random_parts(q, n, k, device, gen) for q in p["qtypes"]}
        for m in p["rows"]:
            x = torch.randn(m, k, device=device, generator=gen).to(dtype)
            dense_us = timer(lambda: torch.nn.functional.linear(x, dense), iters)
            for qtype, parts in weights.items():
                weight_bytes = sum(t.numel() * t.element_size() for t in parts.values())
                nbytes = weight_bytes + (m * k + m * n) * dtype.itemsize
                _, plans = quant_launches(x, qtype, parts)   # planned once: the launches alone are timed
                us = timer(lambda: [launch() for launch in plans], iters)
                floor = nbytes / (copy_gbs * 1e3)   # copy_gbs counts read + write: a read-only floor is lower
                rows.append(dict(projection=proj, qtype=qtype, m=m, n=n, k=k, us=us, weight_mb=weight_bytes / 1e6,
                                 floor_us=floor, pct_of_floor=100 * floor / us, gbs=nbytes / us / 1e3,
                                 dense_us=dense_us, speedup_vs_dense=dense_us / us))
                if log:
                    r = rows[-1]
                    log(f"  {proj:<8} {qtype:<5} M={m:<4d} N={n:<6d} K={k:<6d} {us:9.1f} us  "
                        f"{r['pct_of_floor']:5.1f}% of floor  {r['gbs']:7.0f} GB/s  "
                        f"bf16 GEMM {dense_us:9.1f} us ({r['speedup_vs_dense']:.2f}x)")
        del dense, weights
    return rows


def markdown(checks_rows: list[dict], bench_rows: list[dict]) -> list[str]:
    """Lines for gpu_check.md: failed checks (or their count), and the benchmark table."""
    lines = [f"Quantized GEMM checks: {sum(c['ok'] for c in checks_rows)}/{len(checks_rows)} within bound"]
    lines += [f"- FAIL {c['detail']} {c['dtype']}: max err {c['max_abs_err']:.3g} ({c['bound_ratio']:.2f}x bound)"
              for c in checks_rows if not c["ok"]]
    if bench_rows:
        lines += ["", "| projection | qtype | M | us | % of floor | bf16 GEMM us | speedup |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['projection']} {r['n']}x{r['k']} | {r['qtype']} | {r['m']} | {r['us']:.1f} | "
                  f"{r['pct_of_floor']:.1f} | {r['dense_us']:.1f} | {r['speedup_vs_dense']:.2f} |" for r in bench_rows]
    return lines
