"""gpu-check's decode part (client/tools/gpu_check/run.py runs it in its own process; the greedy part
is client/tools/gpu_check/greedy.py).

The engine's real decode step (LLMEngine.step: scheduling, step inputs, the model, sampling,
outputs) at batch x context points, with CUDA graphs and with enforce_eager, and with
quantization=fp8 (graphs on) where the GPU has fp8 (sm_89+), against the bandwidth floor (weights +
KV read once at the measured copy bandwidth) and beside client.tools.benchmarks.kernel_bench's CUDA-graphed
step of the same model shape built from the kernels alone (the microbenchmark: no engine around
it). The fp8 engine's tokens are compared with the bf16 one's on the same prompts (reported, not
judged: fp8 may flip near-ties).

Graph replay against eager: both engines generate greedily for the same prompts at batch sizes
that are capture sizes (no padding rows), so the replayed graph and the eager step launch the same
kernels on the same shapes: their tokens must be equal, and the first difference is reported.
"""
from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from client.tools.gpu_check.greedy import free

# A prefill that never ends is a failed engine, not a hang of the whole check: steps allowed per
# request token before the part gives up on a point.
MAX_STEPS_PER_POINT = 10_000


def _prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def decode(plan: dict, model_dir: Path, device: str) -> dict:
    from backend import LLM, SamplingParams
    from backend.models.loader import load_model_config
    from backend.models.weights import FP8_MIN_CAPABILITY
    from client.tools.benchmarks import kernel_bench as bench
    bench.P = dict(bench.FULL if device.startswith("cuda") else bench.DRY)
    cfg = load_model_config(str(model_dir))
    copy_gbs = bench.copy_bandwidth(bench.P["copy_gib"], iters=10)
    shapes = plan["decode_shapes"]
    steps = plan["decode_steps"]
    # the first requests to get their first token decode while the others still prefill: enough
    # tokens that none finishes before the timed steps end (every row decodes), and KV for all of
    # them at once (guaranteed_no_evict admits a request with room for all its tokens; 32: blocks)
    max_tokens = {(b, ctx): steps + 8 + -(-b * ctx // plan["max_num_batched_tokens"]) + 1 for b, ctx in shapes}
    kv_tokens = max(b * (ctx + max_tokens[b, ctx] + 32) for b, ctx in shapes)
    on_gpu = device.startswith("cuda")
    variants = [("none", True), ("none", False)]
    fp8 = "skipped: the engine is on the CPU" if not on_gpu else None
    if on_gpu and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        fp8 = "skipped: fp8 needs compute capability 8.9+"
    if fp8 is None:
        variants.append(("fp8", True))
    rows, tokens, replayed = [], {}, {}
    for quantization, graphs in variants:
        llm = LLM(str(model_dir), device=device, attention_backend=plan["attention_backend"], enforce_eager=not graphs,
                  max_num_seqs=max(b for b, _ in shapes), max_num_batched_tokens=plan["max_num_batched_tokens"],
                  max_model_len=plan["max_model_len"], max_tokens_in_paged_kv_cache=kv_tokens,
                  quantization=quantization, inter_token_target_ms=0)   # unpaced: prefill takes the steps counted below
        engine = llm.engine
        weight_bytes = _streamed_weight_bytes(engine.runner, cfg)
        rng = random.Random(9)
        for b, ctx in shapes:
            params = SamplingParams(max_tokens=max_tokens[b, ctx], temperature=0.0, ignore_eos=True)
            reqs = [engine.add_request(f"d{graphs}-{b}-{ctx}-{i}", p, params)
                    for i, p in enumerate(_prompts(rng, [ctx] * b, cfg.vocab_size))]
            _prefill(engine, reqs)                                      # (chunked) to the first token
            engine.step()                                               # a first full decode step
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()                                           # ends with the sampler's read back
                times.append(time.perf_counter() - t0)
            done = [(r.request_id, r.status.value, len(r.output_token_ids)) for r in reqs if r.status.finished]
            if done:
                raise RuntimeError(f"{len(done)} of {b} requests finished during the timed steps ({done[:2]}): the steps "
                                   f"did not decode {b} rows")
            tokens[(quantization, graphs, b, ctx)] = [list(r.output_token_ids[:steps]) for r in reqs]
            for r in reqs:
                engine.abort(r.request_id)
            kv_bytes = cfg.num_layers * 2 * b * (ctx + steps // 2) * cfg.num_kv_heads * cfg.head_dim * engine.runner.dtype.itemsize
            floor_ms = (weight_bytes + kv_bytes) / (copy_gbs * 1e9) * 1e3
            ms = statistics.median(times) * 1e3
            rows.append(dict(batch=b, context=ctx, graphs=graphs, weights=quantization, weight_gb=weight_bytes / 1e9,
                             engine_ms=ms, floor_ms=floor_ms,
                             pct_of_floor=100 * floor_ms / ms, tokens_per_s=b / ms * 1e3,
                             captured=bool(engine.runner.decode_path.graphs and engine.runner.decode_path.graphs.graphs)))
        if quantization == "none":
            replayed[graphs] = _graph_check_tokens(llm, plan["graph_check"], cfg.vocab_size,
                                                   plan["max_num_batched_tokens"])
        llm.close()
        del llm, engine
        free(device)
    micro = _microbench(cfg, shapes, copy_gbs)
    for row in rows:
        m = micro.get((row["batch"], row["context"]))
        row["microbench_ms"] = m
    graph_vs_eager = compare_tokens(replayed[True], replayed[False])
    ok = all(r["captured"] == (r["graphs"] and on_gpu) for r in rows) and graph_vs_eager["ok"]
    if fp8 is None:
        same = [a == b for (q, g, *shape), outs in tokens.items() if q == "fp8"
                for a, b in zip(outs, tokens[("none", True, *shape)])]
        fp8 = f"{sum(same)}/{len(same)} requests with the bf16 engine's {steps} tokens"
    return dict(ok=ok, copy_bandwidth_gbs=copy_gbs, weight_gb=rows[0]["weight_gb"], steps=steps, rows=rows, fp8=fp8,
                graph_vs_eager=graph_vs_eager)


def _prefill(engine, reqs) -> None:
    """Step until every request has its first token; a RuntimeError if that never comes (a request
    that failed has no token to wait for)."""
    for _ in range(MAX_STEPS_PER_POINT):
        if all(r.output_token_ids for r in reqs):
            return
        failed = [r.request_id for r in reqs if r.status.finished and not r.output_token_ids]
        if failed:
            raise RuntimeError(f"requests {failed[:3]} finished without a token")
        engine.step()
    raise RuntimeError(f"no first token after {MAX_STEPS_PER_POINT} engine steps")


def _graph_check_tokens(llm, check: dict, vocab: int, step_tokens: int) -> dict:
    """Greedy tokens of the same seeded prompts at each batch size (a capture size), by batch.
    The prompts of a batch fit one step's `step_tokens`, so all of them prefill in one step and
    decode together to the end: every decode step has exactly `b` rows, no padding. (Staggered
    ones finish one by one, and a step of 50 rows replays the 64-row graph while the eager step
    runs 50: another split count or GEMM tiling, rounding that flips near-ties on random weights;
    the first GPU run, 2026-12-04, met exactly that.)"""
    from backend import SamplingParams

    rng = random.Random(13)
    params = SamplingParams(max_tokens=check["max_tokens"], temperature=0.0, ignore_eos=True)
    out = {}
    for b in check["batches"]:
        low, high = check["prompt"]
        high = min(high, step_tokens // b)
        if high < low:
            raise ValueError(f"graph_check: {b} prompts of at least {low} tokens do not fit one step of {step_tokens}")
        prompts = _prompts(rng, [rng.randint(low, high) for _ in range(b)], vocab)
        out[b] = [list(o.token_ids) for o in llm.generate(prompts, params)]
    return out


def compare_tokens(replayed: dict, eager: dict) -> dict:
    """Graph-replayed against eager tokens, by batch: equal, or the first (batch, request, position)
    where they differ with both tokens."""
    first, requests = None, 0
    for b, outs in replayed.items():
        for i, (a, e) in enumerate(zip(outs, eager[b])):
            requests += 1
            if a != e and first is None:
                pos = next((j for j, (x, y) in enumerate(zip(a, e)) if x != y), min(len(a), len(e)))
                first = dict(batch=b, request=i, position=pos, replayed=a[pos:pos + 1], eager=e[pos:pos + 1])
    same = first is None and all(len(replayed[b]) == len(eager[b]) for b in replayed)
    return dict(ok=same and requests > 0, requests=requests, batches=sorted(replayed), first_diff=first)


def _streamed_weight_bytes(runner, cfg) -> int:
    """The weights a decode step reads: all that the runner holds (fp8 or not) but the embedding
    table, of which a step reads only its tokens' rows (unless the lm_head is the same table)."""
    embed = runner.model.embed_tokens
    table = getattr(embed, "weight", None)
    skip = 0 if cfg.tie_word_embeddings or table is None else table.numel() * table.element_size()
    return runner.weights.weight_bytes - skip


def _microbench(cfg, shapes: list[tuple[int, int]], copy_gbs: float) -> dict:
    """client.tools.benchmarks.kernel_bench's decode step (kernels and matmuls only, CUDA-graphed on a GPU) on this model's
    shape: the same batches and contexts, ms each."""
    from client.tools.benchmarks import kernel_bench as bench
    from kernels.gpu import triton_ops as ops
    bench.P = dict(bench.P, model=dict(bench.LLAMA3_8B, hidden=cfg.hidden_size, layers=cfg.num_layers,
                                       heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                       intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
                                       rope_theta=cfg.rope_theta, eps=cfg.rms_norm_eps))
    out = {}
    for b, ctx in shapes:
        rows = bench.bench_engine_step(ops, copy_gbs, 16, [b], [ctx], iters=10)
        r = rows[0]
        out[(b, ctx)] = (r["graph_us"] if r["graph_us"] is not None else r["eager_us"]) / 1e3
    return out
