"""GPU benchmark and bf16 check of the Triton kernels. One command, a few minutes on an H100/H200:

    python -m client.tools.benchmarks.kernel_bench --out results.json

1. Device copy bandwidth (a large device-to-device copy, CUDA events): the yardstick for every
   memory-bound figure below ("% copy" = achieved GB/s / copy GB/s, bytes read + written).
2. Correctness of every kernel against its torch reference on the GPU, in bf16, fp16 and fp32
   (bf16 cannot be checked under the CPU interpreter).
3. Per-kernel timings (median over many runs, L2 flushed before each run so the data comes from
   HBM, CUDA events) next to the torch reference's time, and torch SDPA's where it applies; the
   fused MoE with Mixtral-8x7B's routing (8 experts, top-2, Llama-3-8B's sizes) against every
   expert on every token (the reference's GPU branch).
4. Paged decode attention at batch 1/16/64 x context 256/1k/4k with Llama-3-8B heads
   (32 q heads, 8 kv heads, head dim 128, bf16), plus a small sweep of tile sizes and splits.
5. An engine-level decode step of a Llama-3-8B-shaped model with random bf16 weights (32 layers of
   rms_norm, qkv matmul, rope, store_kv, decode_attention, o_proj, rms_norm, gate_up matmul,
   silu_mul, down matmul; then the final norm and lm_head), captured in a CUDA graph, at batch
   1/16/64 x context 1k/4k, against the bandwidth floor (weight bytes + KV bytes) / copy bandwidth.

Everything printed is also written to the JSON file. The module imports without a GPU (so --help
works anywhere); it refuses to run without CUDA.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Optional

import torch

from kernels import moe_reference

LLAMA3_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                 vocab=128256, rope_theta=500000.0, eps=1e-5, moe_intermediate=14336)
# The sizes a run uses. FULL is the GPU benchmark; DRY is a tiny CPU rehearsal of the same code
# (--dry-run-cpu, under TRITON_INTERPRET=1) so the script itself is tested without a GPU.
FULL = dict(device="cuda", model=LLAMA3_8B, copy_gib=2.0, flush_mib=256, check_lens=[1, 37, 1000, 3001],
            check_prefill=([300, 129, 1], [0, 517, 2000]), check_tokens=77, kernel_tokens=(1, 64, 4096),
            prefill=((2048, 0), (512, 3584)), max_pos=8192, dtypes=("bfloat16", "float16", "float32"),
            bench_dtype="bfloat16", moe_tokens=(33, 1, 64, 2048))
DRY = dict(device="cpu", model=dict(LLAMA3_8B, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                                    intermediate=96, vocab=256, moe_intermediate=48), moe_tokens=(9,),
           copy_gib=1 / 256, flush_mib=1, check_lens=[1, 37, 70], check_prefill=([20, 9, 1], [0, 17, 40]),
           check_tokens=13, kernel_tokens=(1, 5), prefill=((24, 0), (8, 30)), max_pos=512,
           dtypes=("float16", "float32"), bench_dtype="float16")  # bf16 is wrong under the interpreter
P = FULL


def _dev() -> str:
    return P["device"]


class _CpuEvent:
    """torch.cuda.Event stand-in for the CPU rehearsal (wall-clock, synchronous)."""

    def __init__(self, enable_timing: bool = True):
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "_CpuEvent") -> float:
        return (other.t - self.t) * 1e3


def _event():
    return torch.cuda.Event(enable_timing=True) if _dev() == "cuda" else _CpuEvent()


def _empty_cache() -> None:
    if _dev() == "cuda":
        torch.cuda.empty_cache()


def _sync() -> None:
    if _dev() == "cuda":
        torch.cuda.synchronize()
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
TOL_ELEMENTWISE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.kernel_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="kernel_bench.json", help="JSON results file (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (default: %(default)s)")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes (default: %(default)s)")
    p.add_argument("--contexts", default="256,1024,4096", help="decode context lengths (default: %(default)s)")
    p.add_argument("--engine-contexts", default="1024,4096",
                   help="contexts of the engine-level decode step (default: %(default)s)")
    p.add_argument("--iters", type=int, default=50, help="timed runs per kernel measurement (default: %(default)s)")
    p.add_argument("--skip-engine", action="store_true", help="skip the engine-level decode step")
    p.add_argument("--skip-reference", action="store_true", help="do not time the torch references")
    p.add_argument("--skip-tuning", action="store_true",
                   help="skip the decode tile/split sweep (its variants are compiled for it alone)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and runs (a smoke test)")
    # A tiny rehearsal of this script on the CPU under TRITON_INTERPRET=1 (the tests use it); its
    # numbers mean nothing.
    p.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.batches = [int(x) for x in args.batches.split(",") if x]
        args.contexts = [int(x) for x in args.contexts.split(",") if x]
        args.engine_contexts = [int(x) for x in args.engine_contexts.split(",") if x]
    except ValueError as e:
        p.error(f"batches/contexts must be comma-separated integers: {e}")
    if not args.batches or not args.contexts or min(args.batches + args.contexts + args.engine_contexts) <= 0:
        p.error("batches and contexts must be positive")
    if args.block_size <= 0 or args.iters <= 0:
        p.error("--block-size and --iters must be positive")
    if args.quick:
        args.iters = min(args.iters, 10)
        args.batches, args.contexts, args.engine_contexts = [1, 16], [1024], [1024]
    if args.dry_run_cpu:
        args.iters = min(args.iters, 2)
    return args


# ------------------------------------------------------------------------------------- timing
class Timer:
    """Median GPU time of fn() with CUDA events. Before every run a 256 MiB buffer is zeroed so the
    50 MB L2 of an H100/H200 is flushed (the kernels then read from HBM, as in a real model) and so
    the GPU is busy while the CPU launches the timed call (the Python launch cost is hidden)."""

    def __init__(self) -> None:
        self.flush = torch.empty(P["flush_mib"] * 2**20, dtype=torch.int8, device=_dev())

    def __call__(self, fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        _sync()
        starts = [_event() for _ in range(iters)]
        ends = [_event() for _ in range(iters)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        _sync()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3  # us


def copy_bandwidth(gib: float, iters: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=_dev()).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync()
    times = []
    for _ in range(iters):
        s, e = _event(), _event()
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del src, dst
    _empty_cache()
    return 2 * n / statistics.median(times) / 1e9


# ------------------------------------------------------------------------------------- inputs
def paged_inputs(seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 gen: torch.Generator, spare_blocks: int = 0):
    """A shuffled paged cache holding the sequences, and their int32 block tables."""
    nblocks = [math.ceil(n / block_size) for n in seq_lens]
    nb = sum(nblocks) + spare_blocks + 1
    k_cache = torch.empty(nb, block_size, kv_heads, head_dim, dtype=dtype, device=_dev()).normal_(generator=gen)
    v_cache = torch.empty_like(k_cache).normal_(generator=gen)
    perm = torch.randperm(nb, device=_dev(), generator=gen).to(torch.int32)
    mb = max(nblocks)
    tables = torch.zeros(len(seq_lens), mb, dtype=torch.int32, device=_dev())
    start = 0
    for i, k in enumerate(nblocks):
        tables[i, :k] = perm[start:start + k]
        start += k
    return k_cache, v_cache, tables


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def close(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float]) -> bool:
    return bool(torch.allclose(a.float(), b.float(), atol=tol[0], rtol=tol[1])) and not bool(torch.isnan(a).any())


# ------------------------------------------------------------------------------------- checks
def run_checks(ops, ref, block_size: int) -> list[dict]:
    """Every kernel against its reference on the GPU, in bf16/fp16/fp32."""
    from backend.models.rope import rope_cos_sin
    from backend.models.weights import FP8_MIN_CAPABILITY

    results = []
    m = P["model"]
    h, g, d = m["heads"], m["kv_heads"], m["head_dim"]
    max_pos = P["max_pos"]
    cos, sin = (t.to(_dev()) for t in rope_cos_sin(d, max_pos, m["rope_theta"], LLAMA3_ROPE))

    def record(kernel, dtype, detail, err, ok):
        results.append(dict(kernel=kernel, dtype=str(dtype).replace("torch.", ""), detail=detail,
                            max_abs_err=err, ok=ok))

    for dtype in (getattr(torch, name) for name in P["dtypes"]):
        gen = torch.Generator(device=_dev()).manual_seed(1234)
        tol_e = TOL_ELEMENTWISE[dtype]
        results += cache_checks(ops, ref, block_size, dtype, gen)
        # rms_norm (+ residual)
        x = torch.randn(33, m["hidden"], device=_dev(), generator=gen).to(dtype)
        r = torch.randn(33, m["hidden"], device=_dev(), generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(m["hidden"], device=_dev(), generator=gen)).to(dtype)
        (o1, h1), (o2, h2) = ops.rms_norm(x, w, 1e-5, r), ref.rms_norm(x, w, 1e-5, r)
        record("rms_norm", dtype, f"T=33 N={m['hidden']} +residual", max_err(o1, o2), close(o1, o2, tol_e) and torch.equal(h1, h2))
        # rope
        qk = torch.randn(33, h + 2 * g, d, device=_dev(), generator=gen).to(dtype)
        pos = torch.randint(0, max_pos, (33,), device=_dev(), generator=gen)
        (a1, b1), (a2, b2) = (ops.rotary_embedding(qk[:, :h], qk[:, h:h + g], pos, cos, sin),
                              ref.rotary_embedding(qk[:, :h], qk[:, h:h + g], pos, cos, sin))
        record("rotary_embedding", dtype, "T=33 llama3 scaling", max(max_err(a1, a2), max_err(b1, b2)),
               close(a1, a2, tol_e) and close(b1, b2, tol_e))
        # silu_mul
        x = (4 * torch.randn(33, 2 * m["intermediate"], device=_dev(), generator=gen)).to(dtype)
        o1, o2 = ops.silu_mul(x), ref.silu_mul(x)
        record("silu_mul", dtype, f"T=33 I={m['intermediate']}", max_err(o1, o2), close(o1, o2, tol_e))
        # fused MoE: 8 experts, top-2, two experts given no token (against the dense reference)
        args = moe_inputs(P["moe_tokens"][0], dtype, gen, unused=(2, 5))
        o1, o2 = ops.fused_moe(*args), moe_reference.dense_moe(*args)
        record("fused_moe", dtype, f"T={P['moe_tokens'][0]} E={MOE_EXPERTS} top-{MOE_TOP_K} H={m['hidden']} "
               f"I={m['moe_intermediate']}", max_err(o1, o2), close(o1, o2, TOL[dtype]))
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY:
        results += fp8_cache_checks(ops, ref, block_size)
    return results


MOE_EXPERTS, MOE_TOP_K = 8, 2   # Mixtral-8x7B's routing (its hidden and intermediate sizes are Llama-3-8B's)


def moe_inputs(tokens: int, dtype: torch.dtype, gen: torch.Generator, unused=()) -> tuple:
    """(x, w13, w2, topk_weights, topk_ids) of a random MoE layer of P's shapes; the experts in
    `unused` are never picked."""
    from kernels.moe_reference import route
    m = P["model"]
    hid, inter = m["hidden"], m["moe_intermediate"]
    x = torch.randn(tokens, hid, device=_dev(), generator=gen).to(dtype)
    w13 = (torch.randn(MOE_EXPERTS, 2 * inter, hid, device=_dev(), generator=gen) * hid ** -0.5).to(dtype)
    w2 = (torch.randn(MOE_EXPERTS, hid, inter, device=_dev(), generator=gen) * inter ** -0.5).to(dtype)
    logits = torch.randn(tokens, MOE_EXPERTS, device=_dev(), generator=gen)
    logits[:, list(unused)] = -1e9
    return (x, w13, w2, *route(logits, MOE_TOP_K, renormalize=True))


def cache_checks(ops, ref, block_size: int, dtype: torch.dtype, gen: torch.Generator,
                 cache_dtype: Optional[torch.dtype] = None) -> list[dict]:
    """The kernels that touch the paged cache against their references, q and the activations in
    `dtype`, the cache in `cache_dtype` (default: the same). Decode (context 1, non-multiples, many
    blocks; auto / single / forced splits), prefill (a fresh prompt, a chunk after context, one
    token after a long context) and store_kv; into an fp8 cache, keys past e4m3's +-448 too."""
    fp8 = cache_dtype == torch.float8_e4m3fn
    cache_dtype = cache_dtype or dtype
    label = str(dtype).replace("torch.", "") + (", fp8 KV cache" if fp8 else "")
    m = P["model"]
    h, g, d = m["heads"], m["kv_heads"], m["head_dim"]
    tol, results = TOL[dtype], []

    def record(kernel, detail, err, ok):
        results.append(dict(kernel=kernel, dtype=label, detail=detail, max_abs_err=err, ok=ok))

    def cache(seq_lens):
        k_cache, v_cache, tables = paged_inputs(seq_lens, block_size, g, d, dtype, gen)
        return k_cache.to(cache_dtype), v_cache.to(cache_dtype), tables

    lens = P["check_lens"]
    kc, vc, tables = cache(lens)
    q = torch.randn(len(lens), h, d, device=_dev(), generator=gen).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32, device=_dev())
    want = ref.decode_attention(q, kc, vc, tables, sl, d ** -0.5)
    for ns in ((None, 7) if fp8 else (None, 1, 7)):
        got = ops.decode_attention(q, kc, vc, tables, sl, d ** -0.5, num_splits=ns)
        record("decode_attention", f"lens={lens} splits={ns or 'auto'}", max_err(got, want), close(got, want, tol))
    q_lens, ctx = P["check_prefill"]
    seq = [a + b for a, b in zip(q_lens, ctx)]
    kc, vc, tables = cache(seq)
    q = torch.randn(sum(q_lens), h, d, device=_dev(), generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=_dev())
    sl = torch.tensor(seq, dtype=torch.int32, device=_dev())
    got = ops.prefill_attention(q, kc, vc, tables, cu, sl, d ** -0.5)
    want = ref.prefill_attention(q, kc, vc, tables, cu, sl, d ** -0.5)
    record("prefill_attention", f"q_lens={q_lens} ctx={ctx}", max_err(got, want), close(got, want, tol))
    t = P["check_tokens"]
    key = ((40 if fp8 else 1) * torch.randn(t, g, d, device=_dev(), generator=gen)).to(dtype)
    val = torch.randn(t, g, d, device=_dev(), generator=gen).to(dtype)
    nb = math.ceil(t / block_size) + 8
    slots = torch.randperm(nb * block_size, device=_dev(), generator=gen)[:t]
    slots[::5] = -1
    caches = [torch.full((nb, block_size, g, d), float("nan"), device=_dev()).to(cache_dtype) for _ in range(4)]
    ops.store_kv(key, val, caches[0], caches[1], slots)
    ref.store_kv(key, val, caches[2], caches[3], slots)
    ok = all(torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0)) for a, b in zip(caches[:2], caches[2:]))
    record("store_kv", f"T={t}" + (" (saturating)" if fp8 else ""), 0.0 if ok else float("nan"), ok)
    return results


def fp8_cache_checks(ops, ref, block_size: int, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """kv_cache_dtype=fp8 (sm_89+): the store's e4m3 rounding against torch's, and both attentions
    reading an e4m3 cache in bf16 against the references reading the same cache. (Not in the CPU
    dry run: the interpreter's f32 -> e4m3 conversion is wrong at powers of two.)"""
    gen = torch.Generator(device=_dev()).manual_seed(4321)
    return cache_checks(ops, ref, block_size, dtype, gen, cache_dtype=torch.float8_e4m3fn)


# ------------------------------------------------------------------------------------- kernels
def bench_kernels(ops, ref, timer: Timer, copy_gbs: float, block_size: int, iters: int,
                  skip_reference: bool) -> list[dict]:
    from backend.models.rope import rope_cos_sin

    m = P["model"]
    h, g, d, hid, inter = m["heads"], m["kv_heads"], m["head_dim"], m["hidden"], m["intermediate"]
    dt = getattr(torch, P["bench_dtype"])
    e = dt.itemsize  # bytes per element
    gen = torch.Generator(device=_dev()).manual_seed(7)
    rows = []

    def add(kernel, shape, fn, nbytes, ref_fn=None, sdpa_fn=None, flops=None):
        t = timer(fn, iters)
        row = dict(kernel=kernel, shape=shape, us=t, gbs=nbytes / t / 1e3, pct_copy=100 * nbytes / t / 1e3 / copy_gbs,
                   bytes=nbytes, tflops=(flops / t / 1e6) if flops else None)
        row["ref_us"] = timer(ref_fn, max(3, iters // 10), warmup=1) if ref_fn and not skip_reference else None
        row["sdpa_us"] = timer(sdpa_fn, iters) if sdpa_fn else None
        rows.append(row)
        print_row(row)

    for t in P["kernel_tokens"]:
        key = torch.randn(t, g, d, device=_dev(), generator=gen).to(dt)
        val = torch.randn_like(key)
        nb = math.ceil(t / block_size) + 8
        kc = torch.zeros(nb, block_size, g, d, dtype=dt, device=_dev())
        vc = torch.zeros_like(kc)
        slots = torch.randperm(nb * block_size, device=_dev(), generator=gen)[:t]
        add("store_kv", f"T={t} G={g} D={d}", lambda: ops.store_kv(key, val, kc, vc, slots), 4 * t * g * d * e,
            lambda: ref.store_kv(key, val, kc, vc, slots))

    for t in P["kernel_tokens"]:
        x = torch.randn(t, hid, device=_dev(), generator=gen).to(dt)
        r = torch.randn_like(x)
        w = torch.ones(hid, dtype=dt, device=_dev())
        add("rms_norm+residual", f"T={t} N={hid}", lambda: ops.rms_norm(x, w, 1e-5, r), 4 * t * hid * e + hid * e,
            lambda: ref.rms_norm(x, w, 1e-5, r))

    max_pos = P["max_pos"]
    cos, sin = (c.to(_dev()) for c in rope_cos_sin(d, max_pos, m["rope_theta"], LLAMA3_ROPE))
    for t in P["kernel_tokens"]:
        qkv = torch.randn(t, h + 2 * g, d, device=_dev(), generator=gen).to(dt)
        q, k = qkv[:, :h], qkv[:, h:h + g]
        pos = torch.randint(0, max_pos, (t,), device=_dev(), generator=gen)
        add("rotary_embedding", f"T={t} H={h} G={g} D={d}", lambda: ops.rotary_embedding(q, k, pos, cos, sin),
            2 * t * (h + g) * d * e + 2 * t * d // 2 * 4, lambda: ref.rotary_embedding(q, k, pos, cos, sin))

    for t in P["kernel_tokens"]:
        x = torch.randn(t, 2 * inter, device=_dev(), generator=gen).to(dt)
        add("silu_mul", f"T={t} I={inter}", lambda: ops.silu_mul(x), 3 * t * inter * e, lambda: ref.silu_mul(x))

    # fused MoE at decode and prefill sizes: the floor reads every expert a step touches once
    for t in P["moe_tokens"]:
        args = moe_inputs(t, dt, gen)
        touched = int(torch.unique(args[4]).numel())
        moe_bytes = touched * 3 * hid * m["moe_intermediate"] * e + 2 * t * hid * e
        add("fused_moe", f"T={t} E={MOE_EXPERTS} top-{MOE_TOP_K} I={m['moe_intermediate']}",
            lambda: ops.fused_moe(*args), moe_bytes, lambda: moe_reference.dense_moe(*args),
            flops=2 * t * MOE_TOP_K * 3 * hid * m["moe_intermediate"])

    # prefill: one 2k prompt (compared with dense causal SDPA), and a 512-token chunk after 3.5k context
    for q_len, ctx in P["prefill"]:
        n = q_len + ctx
        kc, vc, tables = paged_inputs([n], block_size, g, d, dt, gen)
        q = torch.randn(q_len, h, d, device=_dev(), generator=gen).to(dt)
        cu = torch.tensor([0, q_len], dtype=torch.int32, device=_dev())
        sl = torch.tensor([n], dtype=torch.int32, device=_dev())
        visible = sum(ctx + i + 1 for i in range(q_len))
        flops = 4 * h * d * visible
        nbytes = 2 * n * g * d * e + 2 * q_len * h * d * e
        sdpa = None
        if ctx == 0:
            qd = q.transpose(0, 1)[None].contiguous()          # [1, H, L, D]
            kd = torch.randn(1, g, n, d, device=_dev(), generator=gen).to(dt)
            vd = torch.randn_like(kd)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True,  # noqa: E731
                                                                           enable_gqa=True)
        add("prefill_attention", f"q={q_len} ctx={ctx} H={h} G={g} D={d}",
            lambda: ops.prefill_attention(q, kc, vc, tables, cu, sl, d ** -0.5, max_q_len=q_len), nbytes,
            lambda: ref.prefill_attention(q, kc, vc, tables, cu, sl, d ** -0.5), sdpa, flops)
    return rows


def bench_decode(ops, ref, timer: Timer, copy_gbs: float, block_size: int, iters: int, batches: list[int],
                 contexts: list[int], skip_reference: bool, tuning_sweep: bool = True) -> tuple[list[dict], list[dict]]:
    """Decode attention sweep (Llama-3-8B heads, bf16) and a small tile-size / split sweep."""
    from kernels.gpu.decode_attention import choose_num_splits
    from kernels.checks import num_sms

    m = P["model"]
    h, g, d = m["heads"], m["kv_heads"], m["head_dim"]
    dt = getattr(torch, P["bench_dtype"])
    e = dt.itemsize
    gen = torch.Generator(device=_dev()).manual_seed(11)
    rows, tuning = [], []
    for b in batches:
        for ctx in contexts:
            lens = [ctx] * b
            kc, vc, tables = paged_inputs(lens, block_size, g, d, dt, gen)
            q = torch.randn(b, h, d, device=_dev(), generator=gen).to(dt)
            sl = torch.tensor(lens, dtype=torch.int32, device=_dev())
            nbytes = 2 * b * ctx * g * d * e + 2 * b * h * d * e + tables.numel() * 4
            splits = choose_num_splits(b, g, tables.shape[1] * block_size, num_sms(q.device))
            t = timer(lambda: ops.decode_attention(q, kc, vc, tables, sl, d ** -0.5), iters)
            # SDPA over the same K/V laid out densely ([B, G, L, D], no paging) for comparison.
            kd = torch.randn(b, g, ctx, d, device=_dev(), generator=gen).to(dt)
            vd = torch.randn_like(kd)
            qd = q[:, :, None, :]
            t_sdpa = timer(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True),
                           iters)
            t_ref = None
            if not skip_reference:
                t_ref = timer(lambda: ref.decode_attention(q, kc, vc, tables, sl, d ** -0.5),
                              max(3, iters // 10), warmup=1)
            row = dict(kernel="decode_attention", shape=f"B={b} ctx={ctx} H={h} G={g} D={d} bs={block_size}",
                       batch=b, context=ctx, splits=splits, us=t, gbs=nbytes / t / 1e3,
                       pct_copy=100 * nbytes / t / 1e3 / copy_gbs, bytes=nbytes, ref_us=t_ref, sdpa_us=t_sdpa,
                       sdpa_pct_copy=100 * nbytes / t_sdpa / 1e3 / copy_gbs, tflops=None)
            rows.append(row)
            print_row(row)
            if tuning_sweep and ctx == max(contexts) and b in (min(batches), max(batches)):
                for block_n in (32, 64, 128):
                    for ns in sorted({splits, max(1, splits // 2), splits * 2}):
                        tt = timer(lambda: ops.decode_attention(q, kc, vc, tables, sl, d ** -0.5, num_splits=ns,
                                                                block_n=block_n), iters)
                        tuning.append(dict(batch=b, context=ctx, block_n=block_n, splits=ns, us=tt,
                                           pct_copy=100 * nbytes / tt / 1e3 / copy_gbs))
            del kc, vc, kd, vd
    _empty_cache()
    return rows, tuning


# ------------------------------------------------------------------------------------- engine step
class Llama8BStep:
    """A Llama-3-8B-shaped decode step built from the kernels and torch matmuls (random bf16
    weights), independent of the engine. Inputs are static buffers so the step can be graphed."""

    def __init__(self, ops, max_batch: int, max_context: int, block_size: int, gen: torch.Generator):
        from backend.models.rope import rope_cos_sin

        m = P["model"]
        self.ops, self.m, self.bs = ops, m, block_size
        self.dtype = dt = getattr(torch, P["bench_dtype"])
        hid, h, g, d, inter = m["hidden"], m["heads"], m["kv_heads"], m["head_dim"], m["intermediate"]

        def w(*shape):
            return torch.empty(*shape, dtype=dt, device=_dev()).normal_(0.0, 0.02, generator=gen)

        self.layers = [dict(ln1=torch.ones(hid, dtype=dt, device=_dev()), qkv=w((h + 2 * g) * d, hid),
                            o=w(hid, h * d), ln2=torch.ones(hid, dtype=dt, device=_dev()),
                            gate_up=w(2 * inter, hid), down=w(hid, inter))
                       for _ in range(m["layers"])]
        self.final_norm = torch.ones(hid, dtype=dt, device=_dev())
        self.lm_head = w(m["vocab"], hid)
        self.weight_bytes = (sum(t.numel() for layer in self.layers for t in layer.values())
                             + self.lm_head.numel() + hid) * dt.itemsize
        self.max_blocks = math.ceil((max_context + 1) / block_size)
        nb = max_batch * self.max_blocks + 1
        self.caches = [(torch.empty(nb, block_size, g, d, dtype=dt, device=_dev()).normal_(0, 0.5, generator=gen),
                        torch.empty(nb, block_size, g, d, dtype=dt, device=_dev()).normal_(0, 0.5, generator=gen))
                       for _ in range(m["layers"])]
        cos, sin = rope_cos_sin(d, max_context + 1, m["rope_theta"], LLAMA3_ROPE)
        self.cos, self.sin = cos.to(_dev()), sin.to(_dev())
        self.gen = gen

    def prepare(self, batch: int, context: int) -> None:
        """Static inputs of one decode step: every sequence has `context` cached tokens and decodes
        the next one (its K/V is stored first, then it attends to context + 1 tokens)."""
        m, bs = self.m, self.bs
        nblk = math.ceil((context + 1) / bs)
        perm = torch.randperm(batch * self.max_blocks, device=_dev(), generator=self.gen)[:batch * nblk]
        self.block_tables = perm.view(batch, nblk).to(torch.int32)
        self.seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=_dev())
        self.positions = torch.full((batch,), context, dtype=torch.int64, device=_dev())
        last = self.block_tables[:, context // bs].long()
        self.slot_mapping = last * bs + context % bs
        self.x = torch.empty(batch, m["hidden"], dtype=self.dtype, device=_dev()).normal_(generator=self.gen)
        self.kv_bytes = m["layers"] * 2 * batch * (context + 1) * m["kv_heads"] * m["head_dim"] * self.dtype.itemsize

    def step(self) -> torch.Tensor:
        ops, m = self.ops, self.m
        b = self.x.shape[0]
        h, g, d = m["heads"], m["kv_heads"], m["head_dim"]
        lin = torch.nn.functional.linear
        hidden, residual = self.x, None
        for layer, (kc, vc) in zip(self.layers, self.caches):
            normed, residual = ops.rms_norm(hidden, layer["ln1"], m["eps"], residual)
            qkv = lin(normed, layer["qkv"]).view(b, h + 2 * g, d)
            q, k = ops.rotary_embedding(qkv[:, :h], qkv[:, h:h + g], self.positions, self.cos, self.sin)
            ops.store_kv(k, qkv[:, h + g:], kc, vc, self.slot_mapping)
            attn = ops.decode_attention(q, kc, vc, self.block_tables, self.seq_lens, d ** -0.5)
            hidden = lin(attn.view(b, h * d), layer["o"])
            normed, residual = ops.rms_norm(hidden, layer["ln2"], m["eps"], residual)
            hidden = lin(ops.silu_mul(lin(normed, layer["gate_up"])), layer["down"])
        normed, _ = ops.rms_norm(hidden, self.final_norm, m["eps"], residual)
        return lin(normed, self.lm_head)


def bench_engine_step(ops, copy_gbs: float, block_size: int, batches: list[int], contexts: list[int],
                      iters: int) -> list[dict]:
    gen = torch.Generator(device=_dev()).manual_seed(3)
    model = Llama8BStep(ops, max(batches), max(contexts), block_size, gen)
    rows = []
    for b in batches:
        for ctx in contexts:
            model.prepare(b, ctx)
            model.step()                      # compile / warm up outside the capture
            _sync()
            eager = _time_plain(model.step, max(3, iters // 5))
            graphed, note = None, ""
            try:
                if _dev() != "cuda":
                    raise RuntimeError("no CUDA graphs on the CPU")
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    model.step()
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(graph):
                    model.step()
                graphed = _time_plain(graph.replay, max(5, iters // 2))
                del graph
            except Exception as exc:  # report and carry on with the eager figure
                note = f"CUDA graph capture failed: {type(exc).__name__}: {exc}"
            best = graphed if graphed is not None else eager
            floor = (model.weight_bytes + model.kv_bytes) / (copy_gbs * 1e3)   # us
            row = dict(batch=b, context=ctx, graph_us=graphed, eager_us=eager, floor_us=floor,
                       pct_of_floor=100 * floor / best, weight_gb=model.weight_bytes / 1e9,
                       kv_gb=model.kv_bytes / 1e9, tokens_per_s=b / best * 1e6, note=note)
            rows.append(row)
            g_txt = f"{graphed / 1e3:8.2f}" if graphed is not None else "     n/a"
            print(f"  B={b:<3d} ctx={ctx:<5d} graph {g_txt} ms  eager {eager / 1e3:8.2f} ms  "
                  f"floor {floor / 1e3:7.2f} ms  ({row['pct_of_floor']:5.1f}% of floor)  "
                  f"{row['tokens_per_s']:9.0f} tok/s  weights {row['weight_gb']:.1f} GB + KV {row['kv_gb']:.2f} GB"
                  + (f"  [{note}]" if note else ""))
    del model
    _empty_cache()
    return rows


def _time_plain(fn: Callable[[], object], iters: int) -> float:
    """Median us of fn() with CUDA events, no L2 flush (the working set is far larger than L2)."""
    times = []
    for _ in range(iters):
        s, e = _event(), _event()
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------- output
HEADER = (f"  {'kernel':<18} {'shape':<40} {'triton us':>10} {'GB/s':>8} {'% copy':>7} {'TFLOP/s':>8} "
          f"{'torch ref us':>13} {'SDPA us':>9}")


def print_row(row: dict) -> None:
    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"
    print(f"  {row['kernel']:<18} {row['shape']:<40} {row['us']:>10.1f} {row['gbs']:>8.0f} {row['pct_copy']:>6.1f}% "
          f"{f(row.get('tflops'), '.1f'):>8} {f(row.get('ref_us'), '.1f'):>13} {f(row.get('sdpa_us'), '.1f'):>9}",
          flush=True)


def _save(results: dict, path: str, partial: bool) -> None:
    """The JSON so far (`partial`: sections may follow), replaced whole so a reader never sees half."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(results, partial=partial), f, indent=2)
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    global P
    args = parse_args(argv)
    if args.dry_run_cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--dry-run-cpu needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
            return 2
        P = DRY
    elif not torch.cuda.is_available():
        print("client.tools.benchmarks.kernel_bench needs a CUDA GPU (the kernels are checked on the CPU by the test suite under "
              "TRITON_INTERPRET=1 instead).", file=sys.stderr)
        return 2
    else:
        P = FULL
    import triton

    from kernels.gpu import quant_bench
    from kernels import reference as ref
    from kernels.gpu import triton_ops as ops
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False   # the fp32 checks compare against exact fp32 math
    if _dev() == "cuda":
        prop = torch.cuda.get_device_properties(0)
        name, sms, mem_gb = prop.name, prop.multi_processor_count, prop.total_memory / 1e9
    else:
        name, sms, mem_gb = "CPU dry run (TRITON_INTERPRET=1; timings are meaningless)", 0, 0.0
    results: dict = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=name, sms=sms, memory_gb=mem_gb,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
        block_size=args.block_size, iters=args.iters,
        timing=f"median of CUDA-event times; L2 flushed ({P['flush_mib']} MiB memset) before each kernel run",
    )
    print(f"{name}: {sms} SMs, {mem_gb:.0f} GB; torch {torch.__version__}, "
          f"triton {triton.__version__}")

    copy_gbs = copy_bandwidth(P["copy_gib"], iters=10 if args.quick else 20)
    results["copy_bandwidth_gbs"] = copy_gbs
    print(f"\ndevice copy bandwidth (read + write): {copy_gbs:.0f} GB/s")

    print(f"\ncorrectness vs the torch references ({' / '.join(P['dtypes'])}):")
    checks = run_checks(ops, ref, args.block_size)
    results["checks"] = checks
    results["quant_checks"] = quant_checks = quant_bench.checks(_dev(), dry=args.dry_run_cpu)
    for c in checks + quant_checks:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['kernel']:<18} {c['dtype']:<9} max|err| {c['max_abs_err']:.2e}  "
              f"{c['detail']}")
    failed = [c for c in checks + quant_checks if not c["ok"]]
    results["failed_checks"] = len(failed)
    _save(results, args.out, partial=True)   # the checks first: kept if the timings are cut short

    timer = Timer()
    print(f"\nkernels (Llama-3-8B shapes, {P['bench_dtype']}, cache block size {args.block_size}):")
    print(HEADER)
    results["kernels"] = bench_kernels(ops, ref, timer, copy_gbs, args.block_size, args.iters, args.skip_reference)

    print("\nquantized GEMMs (kernels/gpu/quant_bench.py; floor = weight + activation bytes / copy bandwidth):")
    _save(results, args.out, partial=True)
    results["quant_linear"] = quant_bench.bench(timer, copy_gbs, args.iters, _dev(), dry=args.dry_run_cpu)
    _save(results, args.out, partial=True)

    print("\npaged decode attention (B sequences x ctx tokens; SDPA = torch SDPA on dense, unpaged K/V):")
    print(HEADER)
    decode_rows, tuning = bench_decode(ops, ref, timer, copy_gbs, args.block_size, args.iters, args.batches,
                                       args.contexts, args.skip_reference, tuning_sweep=not args.skip_tuning)
    results["decode_attention"] = decode_rows
    results["decode_tuning"] = tuning
    _save(results, args.out, partial=True)
    if tuning:
        print("\n  decode tuning (block_n x splits):")
        for r in tuning:
            print(f"    B={r['batch']:<3d} ctx={r['context']:<5d} block_n={r['block_n']:<4d} splits={r['splits']:<3d} "
                  f"{r['us']:9.1f} us  {r['pct_copy']:5.1f}% copy")

    if not args.skip_engine:
        print(f"\nengine-level decode step, Llama-3-8B shape, random {P['bench_dtype']} weights "
              f"({P['model']['layers']} layers + lm_head):")
        results["engine_decode_step"] = bench_engine_step(ops, copy_gbs, args.block_size, args.batches,
                                                          args.engine_contexts, args.iters)

    results["wall_s"] = time.time() - t0
    _save(results, args.out, partial=False)
    print(f"\nwrote {args.out} in {results['wall_s']:.0f} s; "
          + ("all checks passed" if not failed else f"{len(failed)} CHECKS FAILED"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
