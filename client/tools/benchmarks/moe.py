"""CPU speed of the mixture-of-experts layer: the grouped paths (only the experts that have tokens,
on their tokens only) against every expert on every token, in one run.

    python -m client.tools.benchmarks.moe [--tokens 64,256] [--experts 8] [--top-k 2] [--json FILE]

A random Mixtral-shaped MoE block (backend/models/moe.py: router, stacked experts) is built for each
weight format the CPU engine runs experts in, its experts laid out twice from the same weights:
- per expert, as the engine had them before the C kernel: float32 and bfloat16 one oneDNN-packed
  linear each (`pack_experts(block, onednn_linear)`), the packed formats (Q8_0, and llama.cpp's
  4-bit Q4_0 and Q4_K that Mixtral / Qwen3-MoE GGUFs come in) one QuantLinear each (the C kernel
  of kernels/cpu/quant.py). The baseline, kernels/moe_reference.py's `dense_moe` (every expert on
  every token, each output weighted by a routing weight of zero where the token did not pick it),
  and the old grouped path (`grouped_moe`: one GEMM pair per active expert) both call these.
- in one C call per projection for every active expert (kernels/cpu/moe.py `sorted_moe`):
  float32 and bfloat16 experts in the C kernel's panels (`grouped_moe`; what the engine runs for
  float32, and for bfloat16 where oneDNN has no AMX, `cpu_moe.panels_serve`), packed experts as the
  int8 kernel's tiles (kernels/cpu/quant.py `CpuQuantExperts`, what the engine runs).
Q8_0 experts are the float weights quantized (`quantization=int8`); Q4_0 and Q4_K experts random
codes with random scales (kernels/gpu/quant_bench.py `random_parts`), rescaled so their values spread
as the float weights do: the speed does not depend on the values, only the outputs' size does.
`floor_ms` is the grouped path's lower bound where every expert is active: all experts' weight
bytes read once, at one thread's read bandwidth (`--read-gbs`, measured in docs/performance.md).
Each repeat times the three back to back (the machine is shared; ratios come from one run), and
the medians are reported. With one torch thread the clock is the thread's CPU time, so a busy
machine's preemptions do not count (its contention for memory bandwidth still does).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from typing import Optional

import torch

from backend.worker.cpu_memory import keep_freed_memory
from backend.models.loader import ModelConfig
from backend.models.moe import SparseMoeBlock, onednn_linear, pack_experts
from backend.models.quant_linear import QuantLinear, quantize_q8_0
from kernels import cpuinfo
from kernels.cpu import build as cpu_build
from kernels.cpu import elementwise as cpu_elementwise
from kernels.cpu import moe as cpu_moe
from kernels.cpu import quant as cpu_quant
from kernels.cpuinfo import cpu_model  # also cpu_quant.py's, from here
from kernels.moe_reference import dense_moe, grouped_moe, route
from kernels.gpu.quant_bench import random_parts
from kernels.quant_reference import QK, QK_K, dequantize

FORMATS = ("float32", "bfloat16", "Q8_0")   # the default
PACKED = {"Q8_0": QK, "Q4_0": QK, "Q4_K": QK_K}   # packed expert formats -> the values of a block
CHOICES = FORMATS + ("Q4_0", "Q4_K")
READ_GBS = 10.7   # one thread's read bandwidth on the machine of docs/performance.md (a torch sum over 352 MB)


def moe_config(hidden: int, intermediate: int, experts: int, top_k: int) -> ModelConfig:
    return ModelConfig(architecture="MixtralForCausalLM", vocab_size=32, hidden_size=hidden,
                       intermediate_size=intermediate, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=hidden, rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None,
                       max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                       mlp_bias=False, torch_dtype="float32", num_experts=experts, num_experts_per_tok=top_k,
                       moe_intermediate_size=intermediate)


def random_packed(qtype: str, n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A random packed [n, k] matrix whose values spread as k ** -0.5 (as the float weights'):
    random codes and scales, the scales and mins then multiplied by one factor (the values are
    linear in both). Q4_K's mins centre each group as llama.cpp's quantizer does (min = minus
    about half the group's range: 8 D x round(15/16 sub-scale) ~ 7.5 D x sub-scale)."""
    parts = random_parts(qtype, n, k, "cpu", gen)
    if qtype == "Q4_K":
        parts["mins"] = -8 * parts["scales"]
        parts["sub_mins"] = (parts["sub_scales"].float() * 15 / 16).round().to(torch.uint8)
    spread = float(dequantize(qtype, parts).std())
    for name in ("scales", "mins"):
        if name in parts:
            parts[name] = (parts[name].float() * (k ** -0.5 / spread)).half()
    return parts


def packed_linear(qtype: str, weight: torch.Tensor, gen: torch.Generator) -> QuantLinear:
    """One expert's projection in `qtype`: Q8_0 quantizes `weight` (quantization=int8), the 4-bit
    formats stand in random codes of its shape (a GGUF's experts, kept packed)."""
    if qtype == "Q8_0":
        return QuantLinear(qtype, quantize_q8_0(weight))
    return QuantLinear(qtype, random_packed(qtype, *weight.shape, gen))


def build_block(cfg: ModelConfig, fmt: str, seed: int) -> tuple[SparseMoeBlock, tuple]:
    """A block with random weights, its experts one layer each as the engine ran `fmt` before the
    one-call kernels; and the same weights as those take them: the panels (w13, w2) of float
    formats, the CpuQuantExperts (gate/up, down) of packed ones."""
    torch.manual_seed(seed)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    if fmt in PACKED:
        gen = torch.Generator().manual_seed(seed + 2)
        pack_experts(block, lambda w: packed_linear(fmt, w, gen))
        one_call = block.experts.quant_experts
    else:
        block.experts.to(getattr(torch, fmt))
        one_call = cpu_moe.pack_panels(block.experts.w13), cpu_moe.pack_panels(block.experts.w2)
        pack_experts(block, onednn_linear)
    return block.eval(), one_call


def clock():
    """The timer: this thread's CPU time when torch computes on it alone (one thread), which other
    processes on a shared machine cannot inflate by preempting it; else wall-clock time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _time(fn) -> float:
    now = clock()
    start = now()
    fn()
    return now() - start


def measure(fmt: str, cfg: ModelConfig, tokens: int, repeats: int, seed: int = 0, isa=None,
            read_gbs: float = READ_GBS) -> dict:
    block, one_call = build_block(cfg, fmt, seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 1))
    ex = block.experts
    with torch.inference_mode():
        weights, ids = route(block.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        paths = {"dense": lambda: dense_moe(x, ex.gate_up, ex.down, weights, ids),
                 "per_expert": lambda: grouped_moe(x, ex.gate_up, ex.down, weights, ids)}
        if fmt in PACKED:
            paths["one_call"] = lambda: cpu_moe.sorted_moe(x, weights, ids, cfg.num_experts, one_call[0].matmul,
                                                           one_call[1].matmul, cpu_elementwise.silu_mul)
        else:
            paths["one_call"] = lambda: cpu_moe.grouped_moe(x, *one_call, weights, ids, cfg.moe_intermediate_size,
                                                            cpu_elementwise.silu_mul, isa)
        dense = paths["dense"]()   # also warms every path up
        gap = {name: (fn() - dense).abs().max().item() for name, fn in paths.items() if name != "dense"}
        times = {name: [] for name in paths}
        for _ in range(repeats):
            for name, fn in paths.items():
                times[name].append(_time(fn))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    counts = torch.bincount(ids.reshape(-1).long(), minlength=cfg.num_experts).tolist()
    active_bytes = weight_bytes(block, one_call, fmt) * sum(c > 0 for c in counts) / cfg.num_experts
    floor_ms = active_bytes / read_gbs * 1e-6   # the active experts' weights read once
    return dict(format=fmt, weight_mb=round(active_bytes / 1e6, 1), floor_ms=round(floor_ms, 2),
                floor_share=round(floor_ms / ms["one_call"], 2), dense_ms=round(ms["dense"], 3),
                per_expert_ms=round(ms["per_expert"], 3),
                one_call_ms=round(ms["one_call"], 3), speedup_per_expert=round(ms["dense"] / ms["per_expert"], 2),
                speedup_one_call=round(ms["dense"] / ms["one_call"], 2),
                tokens_per_expert=counts, max_abs_difference=max(gap.values()))


def weight_bytes(block: SparseMoeBlock, one_call: tuple, fmt: str) -> int:
    """The bytes of every expert's weights as the grouped path reads them (packed: the kernel's
    tiles, scales included; float: the panels)."""
    if fmt in PACKED:
        return sum(w.nbytes for experts in one_call for w in experts.weights)
    return sum(p.numel() * p.element_size() for p in one_call)


def gemm_scaling(cfg: ModelConfig, tokens: int, repeats: int, isa=None) -> dict:
    """What bounds the speed-up: one expert's float32 gate/up GEMM, its weights hot in cache after
    the first call, at the rows a grouped expert gets on average (tokens x top_k / experts) and at
    all the tokens' rows (the dense path's): oneDNN-packed (the old path's GEMM) and the C kernel.
    The work differs by experts / top_k."""
    rows = max(1, tokens * cfg.num_experts_per_tok // cfg.num_experts)
    weight = torch.randn(2 * cfg.moe_intermediate_size, cfg.hidden_size)
    linear, panels = onednn_linear(weight), cpu_moe.pack_panels(weight[None])
    out = dict(tokens=tokens, grouped_rows=rows)
    with torch.inference_mode():
        for n, key in ((rows, "grouped"), (tokens, "dense")):
            x = torch.randn(n, cfg.hidden_size)
            offsets = torch.tensor([0, n])
            for name, fn in (("onednn", lambda: linear(x)),
                             ("kernel", lambda: cpu_moe.expert_gemm(x, panels, weight.shape[0], offsets, isa))):
                fn()
                t = statistics.median(_time(fn) for _ in range(repeats))
                out[f"{key}_{name}_ms"] = round(t * 1e3, 3)
                out[f"{key}_{name}_gflops"] = round(2 * n * weight.numel() / t * 1e-9, 1)
    return out


def isa() -> str:
    if cpuinfo.this_cpu() is None:
        return "unknown"
    flags = cpuinfo.cpu_flags()
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "neither AVX2 nor AVX-512"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64", help="rows of the batch, comma-separated (default %(default)s)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3584, help="an expert's (Mixtral's ratio: 3.5 x hidden)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"comma-separated, of {','.join(CHOICES)} (default %(default)s)")
    p.add_argument("--read-gbs", type=float, default=READ_GBS,
                   help="one thread's memory read bandwidth, GB/s, for the grouped path's floor (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--kernel-isa", choices=sorted(cpu_build.ISA_FLAGS),
                   help="the C kernel built for this instruction set instead of -march=native (with "
                        "ONEDNN_MAX_CPU_ISA=AVX2 and INFLIGHT_CPU_ISA=avx2 in the environment, which the "
                        "packed formats' kernel follows: an AVX2-only CPU's paths)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    try:
        token_counts = [int(t) for t in args.tokens.split(",") if t]
    except ValueError:
        p.error(f"--tokens: comma-separated integers; got {args.tokens!r}")
    if not token_counts or min(token_counts) < 1:
        p.error(f"--tokens: integers >= 1; got {args.tokens!r}")
    if not formats or set(formats) - set(CHOICES):
        p.error(f"--formats: choose from {', '.join(CHOICES)}; got {args.formats!r}")
    for name in ("experts", "top_k", "hidden", "intermediate", "repeats", "read_gbs"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    for fmt in formats:
        if fmt in PACKED and args.hidden % PACKED[fmt] + args.intermediate % PACKED[fmt]:
            p.error(f"{fmt} needs --hidden and --intermediate multiples of {PACKED[fmt]}")
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc_kept = keep_freed_memory()   # as the engine runs (backend/worker/runner.py): no page faults on each call's outputs
    cfg = moe_config(args.hidden, args.intermediate, args.experts, args.top_k)
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  cpu=cpu_model(), isa=isa(), threads=torch.get_num_threads(),
                  experts=args.experts, top_k=args.top_k, hidden=args.hidden, intermediate=args.intermediate,
                  repeats=args.repeats, clock=clock().__name__, kernel_isa=args.kernel_isa or "native",
                  quant_isa=cpu_quant.chosen_isa() if set(formats) & set(PACKED) else None, read_gbs=args.read_gbs,
                  onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA", "any"), freed_memory_kept=malloc_kept, rows=[])
    print(f"{result['cpu']} ({result['isa']}), {result['threads']} threads; {args.experts} experts, top-{args.top_k}, "
          f"hidden {args.hidden}, intermediate {args.intermediate}; time.{result['clock']}; C kernel build "
          f"{result['kernel_isa']}, packed formats' {result['quant_isa']}, oneDNN up to {result['onednn_max_isa']}; "
          f"read floor at {args.read_gbs} GB/s")
    print("| tokens | weights | every expert (ms) | grouped, per expert (ms) | grouped, one call (ms) | "
          "speed-up per expert | speed-up one call | weights read (MB) | read floor (ms) | floor / one call | "
          "max abs difference | tokens per expert |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for tokens in token_counts:
        for fmt in formats:
            row = dict(tokens=tokens, **measure(fmt, cfg, tokens, args.repeats, isa=args.kernel_isa,
                                                read_gbs=args.read_gbs))
            result["rows"].append(row)
            print(f"| {tokens} | {fmt} | {row['dense_ms']} | {row['per_expert_ms']} | {row['one_call_ms']} | "
                  f"{row['speedup_per_expert']}x | {row['speedup_one_call']}x | {row['weight_mb']} | "
                  f"{row['floor_ms']} | {row['floor_share']} | {row['max_abs_difference']:.2e} | "
                  f"{' '.join(map(str, row['tokens_per_expert']))} |")
    print("\none expert's float32 gate/up GEMM, weights hot in cache (GFLOP/s; oneDNN-packed vs the C kernel):")
    for tokens in token_counts:
        g = gemm_scaling(cfg, tokens, args.repeats, args.kernel_isa)
        result.setdefault("gemm_scaling", []).append(g)
        print(f"  {g['grouped_rows']} rows: oneDNN {g['grouped_onednn_ms']} ms ({g['grouped_onednn_gflops']}), kernel "
              f"{g['grouped_kernel_ms']} ms ({g['grouped_kernel_gflops']}); {tokens} rows: oneDNN "
              f"{g['dense_onednn_ms']} ms ({g['dense_onednn_gflops']}), kernel {g['dense_kernel_ms']} ms "
              f"({g['dense_kernel_gflops']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
