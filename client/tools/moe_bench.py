"""CPU speed of the mixture-of-experts layer: the grouped path (one GEMM pair per expert that has
tokens, on its tokens only) against every expert on every token, in one run.

    python -m client.tools.moe_bench [--tokens 64,256] [--experts 8] [--top-k 2] [--json FILE]

A random Mixtral-shaped MoE block (backend/models/moe.py: router, stacked experts) is built for each
weight format the CPU engine runs experts in: float32 and bfloat16 (oneDNN-packed per expert, as
`pack_experts` lays them out) and Q8_0 (packed-quantized per expert, the C kernel of
kernels/cpu_quant.py). Both paths call the very same per-expert layers on the same routed batch;
the dense one is kernels/moe_reference.py's `dense_moe`, which weights each expert's output by a
routing weight of zero where the token did not pick it. Each repeat times the two back to back
(the machine is shared; ratios come from one run), and the medians are reported. With one torch
thread the clock is the thread's CPU time, so a busy machine's preemptions do not count.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from typing import Optional

import torch

from backend.loader import ModelConfig
from backend.models.moe import SparseMoeBlock, pack_experts
from backend.models.quant_linear import QuantLinear, quantize_q8_0
from kernels.moe_reference import dense_moe, grouped_moe, route

FORMATS = ("float32", "bfloat16", "Q8_0")


def moe_config(hidden: int, intermediate: int, experts: int, top_k: int) -> ModelConfig:
    return ModelConfig(architecture="MixtralForCausalLM", vocab_size=32, hidden_size=hidden,
                       intermediate_size=intermediate, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=hidden, rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                       mlp_bias=False, torch_dtype="float32", num_experts=experts, num_experts_per_tok=top_k,
                       moe_intermediate_size=intermediate)


def build_block(cfg: ModelConfig, fmt: str, seed: int) -> SparseMoeBlock:
    """A block with random weights, its experts laid out per expert as the engine runs `fmt`."""
    torch.manual_seed(seed)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    if fmt == "Q8_0":
        pack_experts(block, lambda w: QuantLinear("Q8_0", quantize_q8_0(w)))
    else:
        block.experts.to(getattr(torch, fmt))
        pack_experts(block)
    return block.eval()


def clock():
    """The timer: this thread's CPU time when torch computes on it alone (one thread), which other
    processes on a shared machine cannot inflate by preempting it; else wall-clock time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _time(fn) -> float:
    now = clock()
    start = now()
    fn()
    return now() - start


def measure(fmt: str, cfg: ModelConfig, tokens: int, repeats: int, seed: int = 0) -> dict:
    block = build_block(cfg, fmt, seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 1))
    ex = block.experts
    with torch.inference_mode():
        weights, ids = route(block.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        grouped = lambda: grouped_moe(x, ex.gate_up, ex.down, weights, ids)  # noqa: E731
        dense = lambda: dense_moe(x, ex.gate_up, ex.down, weights, ids)  # noqa: E731
        gap = (grouped() - dense()).abs().max().item()   # also warms both up
        times = {"grouped": [], "dense": []}
        for _ in range(repeats):
            times["grouped"].append(_time(grouped))
            times["dense"].append(_time(dense))
    g, d = statistics.median(times["grouped"]), statistics.median(times["dense"])
    counts = torch.bincount(ids.reshape(-1).long(), minlength=cfg.num_experts).tolist()
    return dict(format=fmt, grouped_ms=round(g * 1e3, 3), dense_ms=round(d * 1e3, 3), speedup=round(d / g, 2),
                tokens_per_expert=counts, max_abs_difference=gap)


def gemm_scaling(cfg: ModelConfig, tokens: int, repeats: int) -> dict:
    """What bounds the speed-up: one expert's float32 gate/up GEMM (oneDNN-packed, its weights hot
    in cache after the first call) at the rows a grouped expert gets on average (tokens x top_k /
    experts) against all the tokens' rows (the dense path's). The work differs by experts / top_k."""
    from backend.models.moe import onednn_linear
    rows = max(1, tokens * cfg.num_experts_per_tok // cfg.num_experts)
    linear = onednn_linear(torch.randn(2 * cfg.moe_intermediate_size, cfg.hidden_size))
    times = {}
    with torch.inference_mode():
        for n in (rows, tokens):
            x = torch.randn(n, cfg.hidden_size)
            linear(x)
            times[n] = statistics.median(_time(lambda: linear(x)) for _ in range(repeats))
    return dict(tokens=tokens, grouped_rows=rows, grouped_ms=round(times[rows] * 1e3, 3),
                dense_ms=round(times[tokens] * 1e3, 3), ratio=round(times[tokens] / times[rows], 2))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def isa() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "neither AVX2 nor AVX-512"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.moe_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64", help="rows of the batch, comma-separated (default %(default)s)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3584, help="an expert's (Mixtral's ratio: 3.5 x hidden)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of %(default)s")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    try:
        token_counts = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        p.error(f"--tokens: comma-separated integers; got {args.tokens!r}")
    if not token_counts or min(token_counts) < 1:
        p.error(f"--tokens: integers >= 1; got {args.tokens!r}")
    if not formats or set(formats) - set(FORMATS):
        p.error(f"--formats: choose from {', '.join(FORMATS)}; got {args.formats!r}")
    for name in ("experts", "top_k", "hidden", "intermediate", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if "Q8_0" in formats and args.hidden % 32 + args.intermediate % 32:
        p.error("Q8_0 needs --hidden and --intermediate multiples of 32")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = moe_config(args.hidden, args.intermediate, args.experts, args.top_k)
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  cpu=cpu_model(), isa=isa(), threads=torch.get_num_threads(),
                  experts=args.experts, top_k=args.top_k, hidden=args.hidden, intermediate=args.intermediate,
                  repeats=args.repeats, clock=clock().__name__, rows=[])
    print(f"{result['cpu']} ({result['isa']}), {result['threads']} threads; {args.experts} experts, top-{args.top_k}, "
          f"hidden {args.hidden}, intermediate {args.intermediate}; time.{result['clock']}")
    print("| tokens | weights | grouped (ms) | every expert (ms) | speed-up | max abs difference | tokens per expert |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for tokens in token_counts:
        for fmt in formats:
            row = dict(tokens=tokens, **measure(fmt, cfg, tokens, args.repeats))
            result["rows"].append(row)
            print(f"| {tokens} | {fmt} | {row['grouped_ms']} | {row['dense_ms']} | {row['speedup']}x | "
                  f"{row['max_abs_difference']:.2e} | {' '.join(map(str, row['tokens_per_expert']))} |")
    print("\none expert's gate/up GEMM, weights hot in cache (what bounds the grouped path's gain):")
    for tokens in token_counts:
        g = gemm_scaling(cfg, tokens, args.repeats)
        result.setdefault("gemm_scaling", []).append(g)
        print(f"  {g['grouped_rows']} rows {g['grouped_ms']} ms, {tokens} rows {g['dense_ms']} ms: {g['ratio']}x "
              f"for {tokens // g['grouped_rows']}x the work")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
