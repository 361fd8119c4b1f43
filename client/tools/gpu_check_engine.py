"""gpu-check's engine parts (client/tools/gpu_check.py runs each in its own process):

greedy  The engine (on cuda:N, the machine's last GPU, dtype auto: bfloat16 for this float32-free
        bf16 checkpoint) against transformers in float32 on the same GPU and weights, at batch
        1 (one long prompt), 64 and 256, teacher-forced: at every position the engine's token must
        be transformers' argmax or within a near-tie of it (a rounding flip); after a flip the
        texts differ legitimately, and teacher forcing keeps checking on the engine's own path.
decode  The engine's real decode step (LLMEngine.step: scheduling, step inputs, the model,
        sampling, outputs) at batch x context points, with CUDA graphs and with enforce_eager,
        and with quantization=fp8 (graphs on) where the GPU has fp8 (sm_89+), against the
        bandwidth floor (weights + KV read once at the measured copy bandwidth) and beside
        client.tools.kernel_bench's CUDA-graphed step of the same model shape built from the
        kernels alone (the microbenchmark: no engine around it). The fp8 engine's tokens are
        compared with the bf16 one's on the same prompts (reported, not judged: fp8 may flip
        near-ties).
"""
from __future__ import annotations

import math
import random
import statistics
import time
from pathlib import Path

import torch


def _prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def batch_lengths(rng: random.Random, batch: int, low: int, high: int) -> list[int]:
    """Prompt lengths for a batch: log-uniform in [low, high], never block multiples only."""
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(batch)]


def greedy(plan: dict, model_dir: Path, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from backend import LLM, SamplingParams

    rng = random.Random(5)
    batches = [(b, batch_lengths(rng, b, low, high)) for b, low, high in plan["greedy_batches"]]
    start = time.monotonic()
    llm = LLM(str(model_dir), device=device, attention_backend=plan["attention_backend"],
              max_num_seqs=max(b for b, _ in batches), max_num_batched_tokens=plan["max_num_batched_tokens"],
              max_model_len=plan["max_model_len"])
    runner = llm.engine.runner
    engine_info = dict(device=str(runner.device), dtype=str(runner.dtype).replace("torch.", ""),
                       kernels=runner.ops.name, graphs=bool(runner.graphs and runner.graphs.graphs),
                       kv_blocks=runner.num_blocks, start_s=round(time.monotonic() - start, 1))
    vocab = llm.engine.vocab_size
    runs = []
    for b, lengths in batches:
        prompts = _prompts(rng, lengths, vocab)
        t0 = time.monotonic()
        outs = llm.generate(prompts, SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True))
        runs.append((b, prompts, [list(o.token_ids) for o in outs], time.monotonic() - t0))
    del llm, runner
    _free(device)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    results = []
    for b, prompts, outputs, seconds in runs:
        rows = [_teacher_forced(hf, p, o, device, plan["near_tie"]) for p, o in zip(prompts, outputs)]
        bad = [r for r in rows if not r["ok"]]
        results.append(dict(batch=b, prompt_tokens=[min(len(p) for p in prompts), max(len(p) for p in prompts)],
                            tokens=sum(len(o) for o in outputs), engine_s=round(seconds, 2),
                            exact_prefix_min=min(r["same_until"] for r in rows),
                            all_exact=sum(r["same_until"] == r["tokens"] for r in rows),
                            max_gap=max(r["max_gap"] for r in rows), failed=len(bad), worst=bad[:3],
                            ok=not bad and all(r["tokens"] == plan["max_tokens"] for r in rows)))
    del hf
    _free(device)
    expected_dtype = plan["expected_dtype"]
    ok = all(r["ok"] for r in results) and engine_info["dtype"] == expected_dtype and engine_info["device"] == device
    return dict(ok=ok, near_tie=plan["near_tie"], oracle="transformers float32", engine=engine_info,
                expected_dtype=expected_dtype, batches=results)


def _teacher_forced(hf, prompt: list[int], output: list[int], device: str, near_tie: float) -> dict:
    ids = torch.tensor([prompt + output], device=device)
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float()        # the logits that chose each output token
    ours = torch.tensor(output, device=device)
    gap = logits.max(-1).values - logits.gather(1, ours[:, None])[:, 0]  # 0 where ours is the argmax
    exact = int((gap == 0).cumprod(0).sum())
    max_gap = float(gap.max()) if len(output) else 0.0
    return dict(prompt_len=len(prompt), tokens=len(output), same_until=exact, max_gap=max_gap, ok=max_gap <= near_tie)


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def decode(plan: dict, model_dir: Path, device: str) -> dict:
    from backend import LLM, SamplingParams
    from backend.loader import load_model_config
    from backend.models.weights import FP8_MIN_CAPABILITY
    from client.tools import kernel_bench as bench

    bench.P = dict(bench.FULL if device.startswith("cuda") else bench.DRY)
    cfg = load_model_config(str(model_dir))
    copy_gbs = bench.copy_bandwidth(bench.P["copy_gib"], iters=10)
    shapes = plan["decode_shapes"]
    steps = plan["decode_steps"]
    kv_tokens = max(b * (ctx + steps + 16) for b, ctx in shapes)
    on_gpu = device.startswith("cuda")
    variants = [("none", True), ("none", False)]
    fp8 = "skipped: the engine is on the CPU" if not on_gpu else None
    if on_gpu and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        fp8 = "skipped: fp8 needs compute capability 8.9+"
    if fp8 is None:
        variants.append(("fp8", True))
    rows, tokens = [], {}
    for quantization, graphs in variants:
        llm = LLM(str(model_dir), device=device, attention_backend=plan["attention_backend"], enforce_eager=not graphs,
                  max_num_seqs=max(b for b, _ in shapes), max_num_batched_tokens=plan["max_num_batched_tokens"],
                  max_model_len=plan["max_model_len"], max_tokens_in_paged_kv_cache=kv_tokens,
                  quantization=quantization)
        engine = llm.engine
        weight_bytes = _streamed_weight_bytes(engine.runner, cfg)
        rng = random.Random(9)
        for b, ctx in shapes:
            params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
            reqs = [engine.add_request(f"d{graphs}-{b}-{ctx}-{i}", p, params)
                    for i, p in enumerate(_prompts(rng, [ctx] * b, cfg.vocab_size))]
            while any(not r.output_token_ids for r in reqs):           # prefill (chunked) to the first token
                engine.step()
            engine.step()                                               # a first full decode step
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()                                           # ends with the sampler's read back
                times.append(time.perf_counter() - t0)
            tokens[(quantization, graphs, b, ctx)] = [list(r.output_token_ids[:steps]) for r in reqs]
            for r in reqs:
                engine.abort(r.request_id)
            kv_bytes = cfg.num_layers * 2 * b * (ctx + steps // 2) * cfg.num_kv_heads * cfg.head_dim * engine.runner.dtype.itemsize
            floor_ms = (weight_bytes + kv_bytes) / (copy_gbs * 1e9) * 1e3
            ms = statistics.median(times) * 1e3
            rows.append(dict(batch=b, context=ctx, graphs=graphs, weights=quantization, weight_gb=weight_bytes / 1e9,
                             engine_ms=ms, floor_ms=floor_ms,
                             pct_of_floor=100 * floor_ms / ms, tokens_per_s=b / ms * 1e3,
                             captured=bool(engine.runner.graphs and engine.runner.graphs.graphs)))
        del llm, engine
        _free(device)
    micro = _microbench(cfg, shapes, copy_gbs)
    for row in rows:
        m = micro.get((row["batch"], row["context"]))
        row["microbench_ms"] = m
    ok = all(r["captured"] == (r["graphs"] and on_gpu) for r in rows)
    if fp8 is None:
        same = [a == b for (q, g, *shape), outs in tokens.items() if q == "fp8"
                for a, b in zip(outs, tokens[("none", True, *shape)])]
        fp8 = f"{sum(same)}/{len(same)} requests with the bf16 engine's {steps} tokens"
    return dict(ok=ok, copy_bandwidth_gbs=copy_gbs, weight_gb=rows[0]["weight_gb"], steps=steps, rows=rows, fp8=fp8)


def _streamed_weight_bytes(runner, cfg) -> int:
    """The weights a decode step reads: all that the runner holds (fp8 or not) but the embedding
    table, of which a step reads only its tokens' rows (unless the lm_head is the same table)."""
    embed = runner.model.embed_tokens
    table = getattr(embed, "weight", None)
    skip = 0 if cfg.tie_word_embeddings or table is None else table.numel() * table.element_size()
    return runner.weights.weight_bytes - skip


def _microbench(cfg, shapes: list[tuple[int, int]], copy_gbs: float) -> dict:
    """client.tools.kernel_bench's decode step (kernels and matmuls only, CUDA-graphed on a GPU) on this model's
    shape: the same batches and contexts, ms each."""
    from client.tools import kernel_bench as bench
    from kernels import triton_ops as ops

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
