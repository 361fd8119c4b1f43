"""Ahead-of-time compilation of every kernel, as the engine launches it, for sm_80 and sm_90.

    python -m kernels.aot [--json FILE] [--jobs N] [--kernels decode_attention_kernel,...]

No GPU is needed: the `triton` wheel's compiler (with its bundled ptxas) builds cubins for a target
that is not present, and it refuses code that the CPU interpreter runs (e.g. a `tl.dot` with a tile
dimension under 16). For each model shape below, in bf16 and fp16, this builds engine-like CPU
tensors (the layouts and index dtypes of backend/worker/runner.py and backend/models/llama.py), asks each
wrapper's `plan_*` function for its launches, the same function the wrapper itself launches, with
the GPU's configuration, and compiles them through Triton's own argument specialization (so
strides of 1 and 16-byte alignment specialize as at a real launch). The launches are planned at
several step shapes and, for decode attention, every split count the dispatcher can choose
(1..MAX_SPLITS); the rows are distinct compiled variants, so the table also shows that what
changes from step to step compiles nothing new (the engine's warm-up compiles the same set).

It fails (exit 1) on any compile error or on shared memory over the target's per-block limit, and
prints one row per kernel x configuration x dtype x target. --json writes the same rows:
{kernel, config, dtype, target, models, ok, shared_bytes, error}.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Optional

# The kernels must be real @triton.jit functions, not the CPU interpreter's stand-ins: the
# interpreter is chosen when they are decorated (at import), from this variable.
if os.environ.pop("TRITON_INTERPRET", None) == "1" and "triton" in sys.modules:
    raise RuntimeError("kernels.aot: triton was imported under TRITON_INTERPRET=1; run "
                       "`python -m kernels.aot` in a process without it")

from kernels.gpu.aot_launches import (  # noqa: E402, F401  (after the check above; model_launches for the tests)
    DEFAULT_BLOCK_SIZE, DTYPES, MODELS, ModelShape, dtype_variants, model_launches)
from kernels.gpu.launch import Launch  # noqa: E402

DEFAULT_DTYPES = ["bf16", "fp16"]   # what a GPU deployment serves; fp32 on request (--dtypes fp32)
# Shared memory per block with the opt-in attribute (cudaDevAttrMaxSharedMemoryPerBlockOptin):
# 163 KiB on compute capability 8.0 (A100), 227 KiB on 9.0 (H100/H200); CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability".
TARGETS = {"sm_80": (80, 163 * 1024), "sm_90": (90, 227 * 1024)}


def specialize(launch: Launch, arch: int):
    """(signature, constexprs, attrs, options) exactly as a launch of these arguments on `arch`
    would compile them: Triton's own binder, pointed at a target instead of the active driver."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**launch.constexprs, **launch.options()}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options.__dict__


def _compile(job: tuple) -> tuple[bool, Optional[int], str, float]:
    """Compile one specialized kernel (in a worker process): (ok, shared bytes, error, seconds)."""
    module, name, arch, signature, constexprs, attrs, options = job
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    kernel = getattr(importlib.import_module(module), name)
    start = time.perf_counter()
    try:
        compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # a compile error is a result here, reported per configuration
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return False, None, f"{type(exc).__name__}: {' | '.join(lines[-3:])[:400]}", time.perf_counter() - start
    return True, int(compiled.metadata.shared), "", time.perf_counter() - start


def collect(models: dict[str, ModelShape], dtypes: list[str], targets: list[str],
            block_size: int = DEFAULT_BLOCK_SIZE, kernels: Optional[set[str]] = None) -> tuple[list[dict], dict]:
    """One row per distinct (kernel, configuration, dtype, target), listing the models that use it;
    and the compile jobs keyed like the rows. `kernels`: only the launches of these kernels."""
    rows: dict = {}
    jobs: dict = {}
    for model, shape in models.items():
        for dtype_name, launches in (v for name in dtypes for v in dtype_variants(shape, name, block_size)):
            for launch in launches:
                if kernels and launch.name not in kernels:
                    continue
                for target in targets:
                    arch = TARGETS[target][0]
                    if arch < launch.min_arch:
                        continue
                    signature, constexprs, attrs, options = specialize(launch, arch)
                    key = (launch.name, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
                           repr(sorted(attrs.items())), repr(sorted(options.items())), target)
                    if key not in rows:
                        fn = launch.kernel.fn
                        jobs[key] = (fn.__module__, fn.__name__, arch, signature, constexprs, attrs, options)
                        # the runtime-value specializations (ints == 1, 16-divisibility) that set
                        # apart launches of one configuration; the same across dtypes and targets
                        variant = hashlib.sha1(repr((key[2], key[3])).encode()).hexdigest()[:6]
                        rows[key] = dict(kernel=launch.name, config=launch.config(), variant=variant,
                                         dtype=dtype_name, target=target, models=[],
                                         specialized=[n for n, t in signature.items()   # ints == 1
                                                      if t == "constexpr" and n not in launch.constexprs])
                    if model not in rows[key]["models"]:
                        rows[key]["models"].append(model)
    return list(rows.values()), jobs


def run(models: Optional[dict[str, ModelShape]] = None, dtypes: Optional[list[str]] = None,
        targets: Optional[list[str]] = None, jobs: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE, kernels: Optional[set[str]] = None) -> list[dict]:
    """Compile everything (or `kernels`' launches); returns the rows with ok, shared_bytes, error and
    seconds filled in."""
    rows, compile_jobs = collect(models or MODELS, dtypes or DEFAULT_DTYPES, targets or list(TARGETS), block_size,
                                 kernels)
    work = list(compile_jobs.values())
    workers = jobs or min(len(work), os.cpu_count() or 1)
    if workers > 1:
        # spawn: a fresh interpreter per worker, not a fork of one that has torch threads running
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_compile, work, chunksize=4))
    else:
        results = [_compile(job) for job in work]
    for row, (ok, shared, error, seconds) in zip(rows, results):
        limit = TARGETS[row["target"]][1]
        if ok and shared > limit:
            ok, error = False, f"shared memory {shared} B > {row['target']} limit {limit} B"
        row.update(ok=ok, shared_bytes=shared, error=error, seconds=round(seconds, 3))
    return rows


def format_table(rows: list[dict]) -> str:
    """A markdown table: one line per kernel x configuration (x specialization variant), one column
    per dtype x target with the shared memory in bytes, or FAIL."""
    columns = sorted({(r["dtype"], r["target"]) for r in rows})
    groups: dict = {}
    for r in rows:
        group = groups.setdefault((r["kernel"], json.dumps(r["config"]), r["variant"]),
                                  {"row": r, "cells": {}, "models": []})
        group["cells"][(r["dtype"], r["target"])] = str(r["shared_bytes"]) if r["ok"] else "FAIL"
        group["models"] += [m for m in r["models"] if m not in group["models"]]
    lines = ["| kernel | configuration | variant | " + " | ".join(f"{d} {t}" for d, t in columns) + " | models |",
             "| --- | --- | --- | " + " | ".join("---:" for _ in columns) + " | --- |"]
    for (kernel, _, variant), group in sorted(groups.items()):
        r = group["row"]
        config = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in r["config"].items())
        if r["specialized"]:
            config += " (=1: " + ",".join(r["specialized"]) + ")"
        cells = " | ".join(group["cells"].get(c, "-") for c in columns)
        lines.append(f"| {kernel} | {config} | {variant} | {cells} | {', '.join(group['models'])} |")
    failures = [f"- {r['kernel']} {r['dtype']} {r['target']} {r['variant']}: {r['error']}" for r in rows if not r["ok"]]
    return "\n".join(lines + ([""] + failures if failures else []))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.aot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--jobs", type=int, default=0, help="compile processes (default: one per CPU core)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="KV cache block size (kv_block_size; default %(default)s)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: %(default)s)")
    p.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES),
                   help=f"comma-separated, of {', '.join(DTYPES)} (default: %(default)s)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated (default: %(default)s)")
    p.add_argument("--kernels", default="", help="comma-separated kernel names (e.g. decode_attention_kernel): "
                   "only their launches (default: every kernel)")
    args = p.parse_args(argv)
    chosen = {}
    for arg, known in (("models", MODELS), ("dtypes", DTYPES), ("targets", TARGETS)):
        chosen[arg] = [x for x in getattr(args, arg).split(",") if x]
        unknown = [x for x in chosen[arg] if x not in known]
        if unknown or not chosen[arg]:
            p.error(f"--{arg}: unknown {unknown or 'empty list'}; choose from {', '.join(known)}")
    if args.jobs < 0:
        p.error(f"--jobs must be >= 0; got {args.jobs}")
    if args.block_size < 1:
        p.error(f"--block-size must be >= 1; got {args.block_size}")
    kernels = {k for k in args.kernels.split(",") if k}
    if kernels:
        known = {r["kernel"] for r in collect({m: MODELS[m] for m in chosen["models"]}, chosen["dtypes"],
                                              chosen["targets"], args.block_size)[0]}
        if kernels - known:
            p.error(f"--kernels: {sorted(kernels - known)} not launched for these models, dtypes and targets; "
                    f"choose from {', '.join(sorted(known))}")
    start = time.perf_counter()
    rows = run({m: MODELS[m] for m in chosen["models"]}, chosen["dtypes"], chosen["targets"],
               jobs=args.jobs, block_size=args.block_size, kernels=kernels)
    print(format_table(rows))
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows)} kernel x configuration x dtype x target compiled in "
          f"{time.perf_counter() - start:.0f} s: {len(rows) - len(failed)} ok, {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": {t: {"arch": a, "shared_limit_bytes": lim} for t, (a, lim) in TARGETS.items()},
                       "models": {m: vars(MODELS[m]) for m in chosen["models"]}, "block_size": args.block_size,
                       "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
