"""Ahead-of-time compilation of every kernel, as the engine launches it, for sm_80 and sm_90.

    python -m kernels.aot [--json FILE] [--jobs N]

No GPU is needed: the `triton` wheel's compiler (with its bundled ptxas) builds cubins for a target
that is not present, and it refuses code that the CPU interpreter runs (e.g. a `tl.dot` with a tile
dimension under 16). For each model shape below, in bf16 and fp16, this builds engine-like CPU
tensors (the layouts and index dtypes of backend/runner.py and backend/models/llama.py), asks each
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
from dataclasses import dataclass, replace
from multiprocessing import get_context
from typing import Optional

import torch

# The kernels must be real @triton.jit functions, not the CPU interpreter's stand-ins: the
# interpreter is chosen when they are decorated (at import), from this variable.
if os.environ.pop("TRITON_INTERPRET", None) == "1" and "triton" in sys.modules:
    raise RuntimeError("kernels.aot: triton was imported under TRITON_INTERPRET=1; run "
                       "`python -m kernels.aot` in a process without it")

from kernels import decode_attention as decode_mod  # noqa: E402
from kernels.activation import plan_silu_mul  # noqa: E402
from kernels.launch import Launch  # noqa: E402
from kernels.lora_reference import Segments  # noqa: E402
from kernels.lora_sgmv import plan_lora_expand, plan_lora_shrink  # noqa: E402
from kernels.norm import plan_rms_norm  # noqa: E402
from kernels.prefill_attention import plan_prefill_attention  # noqa: E402
from kernels.quant_dispatch import aot_launches as quant_launches  # noqa: E402
from kernels.rope import plan_rotary_embedding  # noqa: E402
from kernels.store_kv import plan_store_kv  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool = False


# The config.json fields of the public checkpoints on the Hugging Face Hub (hidden_size,
# num_attention_heads, num_key_value_heads, head_dim = hidden_size / num_attention_heads,
# intermediate_size):
MODELS = {
    "Llama-3.1-8B": ModelShape(4096, 32, 8, 128, 14336),    # meta-llama/Llama-3.1-8B
    "Llama-3.2-1B": ModelShape(2048, 32, 8, 64, 8192),      # meta-llama/Llama-3.2-1B
    "Qwen2-7B": ModelShape(3584, 28, 4, 128, 18944, True),  # Qwen/Qwen2-7B
    "Mistral-7B": ModelShape(4096, 32, 8, 128, 14336),      # mistralai/Mistral-7B-v0.1
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_DTYPES = ["bf16", "fp16"]   # what a GPU deployment serves; fp32 on request (--dtypes fp32)
# Shared memory per block with the opt-in attribute (cudaDevAttrMaxSharedMemoryPerBlockOptin):
# 163 KiB on compute capability 8.0 (A100), 227 KiB on 9.0 (H100/H200); CUDA C++ Programming
# Guide, "Technical Specifications per Compute Capability".
TARGETS = {"sm_80": (80, 163 * 1024), "sm_90": (90, 227 * 1024)}
DEFAULT_BLOCK_SIZE = 16   # EngineConfig.kv_block_size's default


# Step shapes the launches are planned at: (tokens, decode sequences, block-table width). The
# integers that change from step to step are not specialized by the kernels, so every shape lands
# on the same compiled variants: the sweep shows it (the rows are deduplicated by variant).
STEP_SHAPES = ((6, 2, 3), (1, 1, 1), (48, 16, 64), (256, 256, 2048))


def model_launches(shape: ModelShape, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> list[Launch]:
    """Every launch an engine step of this model makes, with the engine's argument layouts (q and k
    strided views of the fused qkv projection, v contiguous, index tensors int32, slots and
    positions int64), at each of STEP_SHAPES and, for decode attention, every split count."""
    launches: list[Launch] = []
    for tokens, seqs, width in STEP_SHAPES:
        launches += _step_launches(shape, dtype, block_size, tokens, seqs, width)
    # the quantized GEMMs of the four projections (their variants do not depend on the step shape)
    h, g, d = shape.heads, shape.kv_heads, shape.head_dim
    launches += quant_launches({"qkv": ((h + 2 * g) * d, shape.hidden, shape.qkv_bias), "o": (shape.hidden, h * d, False),
                                "gate_up": (2 * shape.intermediate, shape.hidden, False),
                                "down": (shape.hidden, shape.intermediate, False)}, dtype)
    launches += lora_launches(shape, dtype)
    return launches


# LoRA (backend/lora/): the slot ranks compiled (max_lora_rank padded to a power of two >= 16), and
# the segments of a step (the kernels read them from the device; only the grid changes with them).
LORA_RANKS = (16, 64)
LORA_SLOTS = 4


def lora_launches(shape: ModelShape, dtype: torch.dtype) -> list[Launch]:
    """The segmented shrink and expand of each fused projection, as backend/lora/step.py launches
    them: the banks of LORA_SLOTS slots, x and out in the model's dtype, y float32."""
    h, g, d, hidden, inter = shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, shape.intermediate
    projections = {"qkv": (hidden, (0, h * d, (h + g) * d, (h + 2 * g) * d)), "o": (h * d, (0, hidden)),
                   "gate_up": (hidden, (0, inter, 2 * inter)), "down": (inter, (0, hidden))}
    launches = []
    for rank in LORA_RANKS:
        for tokens in (1, 48):
            table = torch.zeros(3, 2 * LORA_SLOTS, dtype=torch.int32)
            segments = Segments([], table[0], table[1], table[2], tokens)
            for fan_in, bounds in projections.values():
                shards = len(bounds) - 1
                x = torch.zeros(tokens, fan_in, dtype=dtype)
                out = torch.zeros(tokens, bounds[-1], dtype=dtype)
                a_bank = torch.zeros(LORA_SLOTS, shards * rank, fan_in, dtype=dtype)
                b_bank = torch.zeros(LORA_SLOTS, bounds[-1], rank, dtype=dtype)
                y = torch.zeros(tokens, shards * rank, dtype=torch.float32)
                launches += [plan_lora_shrink(x, a_bank, y, segments), plan_lora_expand(y, b_bank, bounds, segments, out)]
    return launches


# kv_cache_dtype=fp8 (sm_89+): the launches that touch the cache, again with an e4m3 cache beside
# bf16/fp16 activations; a column of their own in the table ("bf16+kv-fp8")
KV_FP8 = "+kv-fp8"
KV_FP8_ARCH = 89


def kv_fp8_launches(shape: ModelShape, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> list[Launch]:
    """The cache's store and the two attentions with an fp8 cache, at each of STEP_SHAPES."""
    fp8 = torch.float8_e4m3fn
    return [replace(launch, min_arch=KV_FP8_ARCH)
            for tokens, seqs, width in STEP_SHAPES
            for launch in _step_launches(shape, dtype, block_size, tokens, seqs, width, kv_dtype=fp8)
            if any(isinstance(a, torch.Tensor) and a.dtype == fp8 for a in launch.args)]


def dtype_variants(shape: ModelShape, dtype_name: str, block_size: int) -> list[tuple[str, list[Launch]]]:
    """(column label, launches): the dtype's own, and for bf16/fp16 its fp8-cache launches."""
    dtype = DTYPES[dtype_name]
    variants = [(dtype_name, model_launches(shape, dtype, block_size))]
    if dtype != torch.float32:
        variants.append((dtype_name + KV_FP8, kv_fp8_launches(shape, dtype, block_size)))
    return variants


def _step_launches(shape: ModelShape, dtype: torch.dtype, block_size: int, tokens: int, seqs: int,
                   table_width: int, kv_dtype: Optional[torch.dtype] = None) -> list[Launch]:
    h, g, d = shape.heads, shape.kv_heads, shape.head_dim
    qkv = torch.zeros(tokens, (h + 2 * g) * d, dtype=dtype)
    q, k, v = qkv.split((h * d, g * d, g * d), dim=-1)
    q, k, v = q.view(tokens, h, d), k.view(tokens, g, d), v.reshape(tokens, g, d).contiguous()
    k_cache = torch.zeros(4, block_size, g, d, dtype=kv_dtype or dtype)   # the values are never read: any blocks do
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(max(seqs, 2), table_width, dtype=torch.int32)
    seq_lens = torch.ones(max(seqs, 2), dtype=torch.int32)
    cos = torch.zeros(64, d // 2, dtype=torch.float32)
    positions = torch.zeros(tokens, dtype=torch.int64)
    q_rot, k_rot = torch.empty(tokens, h, d, dtype=dtype), torch.empty(tokens, g, d, dtype=dtype)
    x = torch.zeros(tokens, shape.hidden, dtype=dtype)
    weight = torch.ones(shape.hidden, dtype=dtype)
    gate_up = torch.zeros(tokens, 2 * shape.intermediate, dtype=dtype)
    scale = d ** -0.5
    prefill_seqs = 2 if tokens > 1 else 1
    cu = torch.tensor([0, tokens // 2, tokens][-prefill_seqs - 1:], dtype=torch.int32)

    launches = [
        plan_rms_norm(x, weight, 1e-5, None, torch.empty_like(x), x),                     # first layer
        plan_rms_norm(x, weight, 1e-5, x.clone(), torch.empty_like(x), torch.empty_like(x)),
        plan_rotary_embedding(q, k, positions, cos, cos.clone(), q_rot, k_rot),
        plan_store_kv(k_rot, v, k_cache, v_cache, torch.zeros(tokens, dtype=torch.int64)),
        plan_silu_mul(gate_up, torch.empty(tokens, shape.intermediate, dtype=dtype)),
        plan_prefill_attention(q_rot, k_cache, v_cache, tables[:prefill_seqs], cu, seq_lens[:prefill_seqs],
                               scale, torch.empty_like(q_rot), tokens, on_gpu=True),
    ]
    n = min(seqs, tokens)
    decode_q = q_rot[:n]
    for num_splits in range(1, decode_mod.MAX_SPLITS + 1):
        launches += decode_mod.plan_decode_attention(decode_q, k_cache, v_cache, tables[:n], seq_lens[:n], scale,
                                                     torch.empty_like(decode_q), num_splits,
                                                     decode_mod.DEFAULT_BLOCK_N)
    return launches


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
            block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[list[dict], dict]:
    """One row per distinct (kernel, configuration, dtype, target), listing the models that use it;
    and the compile jobs keyed like the rows."""
    rows: dict = {}
    jobs: dict = {}
    for model, shape in models.items():
        for dtype_name, launches in (v for name in dtypes for v in dtype_variants(shape, name, block_size)):
            for launch in launches:
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
        block_size: int = DEFAULT_BLOCK_SIZE) -> list[dict]:
    """Compile everything; returns the rows with ok, shared_bytes, error and seconds filled in."""
    rows, compile_jobs = collect(models or MODELS, dtypes or DEFAULT_DTYPES, targets or list(TARGETS), block_size)
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
    start = time.perf_counter()
    rows = run({m: MODELS[m] for m in chosen["models"]}, chosen["dtypes"], chosen["targets"],
               jobs=args.jobs, block_size=args.block_size)
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
