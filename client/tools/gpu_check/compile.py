"""gpu-check's compile part, and the count of Triton compiles every part reports.

On a machine with a cold Triton cache each kernel variant compiles at its first launch, one after
another, in the middle of whichever part meets it first (about 200 variants for the check's model
and kernel_bench's Llama-3-8B shapes in three dtypes, seconds each). This part compiles them all
first, in parallel processes, through kernels.aot: the same launches the engine's wrappers plan
(tests/test_warmup_variants.py shows the warm-up's launches are among them), specialized by
Triton's own binder for this GPU's target and compiled by `triton.compile` with the options a
launch passes, so each lands in Triton's cache under the key a launch looks up. The later parts
then load binaries instead of compiling; each part's `triton_compiles` (hits and misses, from
Triton's compilation listener) shows on the GPU whether they did. The check's model comes first,
so a part cut short by its budget still leaves the engine's variants compiled.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from typing import Optional


class CompileCounter:
    """Triton's compilation listener (triton.knobs.compilation.listener, triton >= 3.4): counts
    binaries compiled (misses) and loaded from the cache (hits) in this process, with the seconds."""

    def __init__(self):
        self.hits = self.misses = 0
        self.seconds = 0.0

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit, **_):
        if cache_hit:
            self.hits += 1
        else:
            self.misses += 1
        self.seconds += getattr(times, "total", 0) / 1e6   # CompileTimes, in microseconds

    def install(self) -> "CompileCounter":
        try:
            from triton import knobs
            knobs.compilation.listener = self
        except (ImportError, AttributeError):  # an older triton: nothing counted, the part still runs
            pass
        return self

    def report(self) -> dict:
        return dict(hits=self.hits, misses=self.misses, seconds=round(self.seconds, 1))


def model_shape(config: dict):
    """kernels.aot's ModelShape of a make_model config (the check's own checkpoint)."""
    from kernels.gpu.aot_launches import ModelShape

    heads = config["num_attention_heads"]
    return ModelShape(config["hidden_size"], heads, config["num_key_value_heads"],
                      config.get("head_dim") or config["hidden_size"] // heads, config["intermediate_size"])


def check_shapes() -> dict:
    """kernels.aot's ModelShapes of the greedy part's own images and pooling checkpoints
    (client/tools/gpu_check/vision.py: a tiny Gemma 3 with a 13-token window; pooling.py: a tiny
    Qwen3), run in float32: so the compile part covers the variants those cases launch."""
    from kernels.gpu.aot_launches import GEMMA3, ModelShape

    return {"gpu-check-vision": ModelShape(64, 4, 2, 32, 160, window=13, **GEMMA3),
            "gpu-check-pooling": ModelShape(64, 4, 2, 32, 160, qk_norm=True)}


def _compile_counted(job: tuple) -> tuple:
    """kernels.aot's compile of one variant in a worker, and whether Triton's cache already had it."""
    from kernels import aot

    counter = CompileCounter().install()
    ok, shared, error, seconds = aot._compile(job)
    return ok, shared, error, seconds, counter.hits > 0


def compile_kernels(plan: dict, arch: Optional[int], progress: dict, jobs: int = 0) -> dict:
    """Compile every variant of plan['compile_models'] x plan['compile_dtypes'] for sm_<arch> (the
    dry run: sm_90) in `jobs` processes (default: one per core). `progress` is filled as results
    come in, so a cut part still reports how far it got."""
    from kernels import aot

    target = f"sm_{arch or 90}"
    if target not in aot.TARGETS:
        return dict(ok=True, skipped=f"kernels.aot compiles for {', '.join(aot.TARGETS)}; this GPU is {target}: "
                                     "each part compiles what it launches")
    start = time.monotonic()
    shapes = {**aot.MODELS, **check_shapes(), "gpu-check": model_shape(plan["model"])}
    models = {name: shapes[name] for name in plan["compile_models"]}
    rows, work = aot.collect(models, list(plan["compile_dtypes"]), [target])
    planned, jobs_of = len(rows), dict(zip(map(id, rows), work.values()))
    if plan["compile_max_variants"]:   # the dry run: each kernel's first variant, then the others in order
        firsts = [r for i, r in enumerate(rows) if all(q["kernel"] != r["kernel"] for q in rows[:i])]
        rows = (firsts + [r for r in rows if all(r is not f for f in firsts)])[:plan["compile_max_variants"]]
    work = {id(r): jobs_of[id(r)] for r in rows}
    progress.update(target=target, variants=len(rows), planned=planned, compiled=0, cached=0, failed=[],
                    plan_s=round(time.monotonic() - start, 1))
    workers = jobs or os.cpu_count() or 1
    progress["workers"] = workers
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))
    try:
        futures = {pool.submit(_compile_counted, job): row for row, job in zip(rows, work.values())}
        for future in as_completed(futures):
            ok, shared, error, seconds, cached = future.result()
            row = futures[future]
            limit = aot.TARGETS[target][1]
            if ok and shared > limit:
                ok, error = False, f"shared memory {shared} B > {target} limit {limit} B"
            progress["compiled"] += 1
            progress["cached"] += cached
            if not ok:
                progress["failed"].append(dict(kernel=row["kernel"], dtype=row["dtype"], config=row["config"],
                                               error=error))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    progress["seconds"] = round(time.monotonic() - start, 1)
    return dict(progress, ok=not progress["failed"] and progress["compiled"] == len(rows))
