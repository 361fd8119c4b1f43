"""The step probe (`inflight bench --step-probe`): how close an engine decode step is to its matmuls.

    inflight bench --step-probe --model-path models/smollm2-135m-instruct --batch-sizes 1,16,64
    inflight bench --step-probe --model-path models/smollm2-135m-instruct --long-prompts 2048,4000
    inflight bench --step-probe --model-path models/default --profile 16   # where a step's time goes
    inflight bench --step-probe --model-path models/smollm2-135m-instruct-q4_1   # packed weights
    inflight bench --step-probe --model-path models/smollm2-135m-instruct --param dtype=bfloat16

Decode: for each batch size B, B requests with `--context`-token prompts are prefilled, then
`--steps` full engine steps (schedule, model, sampling, postprocess) are timed against the same
step's matmuls alone: every layer's qkv, o, gate_up and down projections (a mixture of experts'
layer: its router and the min(B x top_k, E) experts a fixed routing gives B rows) and the lm_head,
on the model's own weights, for B rows (step_floor.py). The two are timed interleaved (engine,
floor, floor, engine) in one process, so a noisy machine skews both alike; the report is the ratio
("% of floor").

The floor itself is set against what bounds it: the bytes of weights one step reads (packed ones
as they are held: 4-5 bits a weight for GGUF folders), the bandwidth the matmuls got from them, and
their arithmetic (GOP/s: 2 x weights x rows) against the GEMM's own peak, measured once on the
model's gate/up projection with 256 rows (compute-bound: integer VNNI dot products for packed
weights, oneDNN's float or bf16 GEMM otherwise). The bandwidth floor is the other bound: the step's
weight bytes over the memory's measured read bandwidth (a sum over MEMORY_BYTES, past any cache),
beside the read bandwidth of a buffer as big as those weights (what a step gets when they stay in a
large last-level cache, which can beat the memory floor).

Long prompts: one prompt of each length to its first token through the engine, chunked (the
default token budget) and unchunked (a budget of the whole prompt), beside transformers' forward
pass on the same ids, interleaved the same way, prefix reuse off (before 2026-12-06 it was on, and
the second of the two engine runs was a prefix hit: the engine's figure was about half its time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from client.tools.benchmarks.step_floor import gemm_peak_gop_s, matmul_floor, step_weights
from client.tools.benchmarks.workloads import FIRST_ID
from templates.render import parse_param


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers; got '{text}'")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="inflight bench --step-probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch-sizes", type=_ints, default=[1, 16, 64])
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding request")
    p.add_argument("--steps", type=int, default=8, help="rounds of A B B A (engine step, matmuls alone)")
    p.add_argument("--long-prompts", type=_ints, default=[], help="prompt lengths for the first-token check")
    p.add_argument("--profile", type=int, default=0, metavar="B", help="print a torch profile of a batch-B step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param", action="append", type=parse_param, default=[], metavar="KEY=VALUE",
                   help="an engine parameter (config.pbtxt key), e.g. dtype=bfloat16 or kv_cache_dtype=bfloat16")
    p.add_argument("--output-json", type=Path)
    return p


def _random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(FIRST_ID, vocab, n)]


def interleaved(a: Callable[[], None], b: Callable[[], None], rounds: int = 1) -> tuple[float, float]:
    """Median seconds of one call of a and of b, timed A B B A per round so that drifting load hits
    both alike; the median of many short calls ignores the bursts a shared machine adds."""
    times: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(rounds):
        for name, fn in (("a", a), ("b", b), ("b", b), ("a", a)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return float(np.median(times["a"])), float(np.median(times["b"]))


# -- decode steps against their matmul floor (step_floor.py) --------------------------------------
MEMORY_BYTES = 2**30  # past the last-level cache of the machines at hand (480 MiB on the largest)


def read_bandwidth_gb_s(nbytes: int, calls: int = 5) -> float:
    """Read bandwidth in GB/s over an `nbytes` buffer: the fastest of `calls` float32 sums, on the
    torch threads the engine set (a sum reads each byte once and computes next to nothing). The
    buffer lies in the pages the engine gives its weights (2 MB ones unless INFLIGHT_HUGE_PAGES=0,
    kernels/cpu/huge_pages.py): in 4 KB pages one sum here read 27 GB/s where 2 MB pages read 38."""
    from kernels.cpu import huge_pages
    x = huge_pages.empty((max(nbytes // 4, 1024),), torch.float32).fill_(1.0)
    x.sum()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times) / 1e9


def _decoding_engine(model_path: str, batch: int, context: int, max_tokens: int, seed: int,
                     params: Optional[dict] = None):
    from backend import LLM, SamplingParams
    llm = LLM(model_path, max_num_seqs=max(batch, 1), cpu_kv_cache_tokens=batch * (context + max_tokens + 32),
              max_num_batched_tokens=max(2048, context), **(params or {}))
    vocab = llm.engine.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        llm.engine.add_request(f"probe-{i}", _random_ids(rng, context, vocab), params)
    produced: dict[str, int] = {}
    while len(produced) < batch:  # every request prefilled and one decode step in: all decode now
        for out in llm.engine.step():
            produced[out.request_id] = len(out.token_ids)
    llm.engine.step()
    return llm


def probe_decode(model_path: str, batch: int, context: int, steps: int, seed: int,
                 params: Optional[dict] = None) -> dict:
    llm = _decoding_engine(model_path, batch, context, max_tokens=2 * steps + 8, seed=seed, params=params)
    engine = llm.engine

    model = engine.runner.model
    floor = matmul_floor(model, batch)
    floor()  # first-call allocations out of the clock
    step_s, floor_s = interleaved(engine.step, floor, rounds=steps)
    while engine.has_work():
        engine.step()
    weight_bytes, weights = step_weights(model, batch)
    memory_gb_s = read_bandwidth_gb_s(MEMORY_BYTES)
    bandwidth_floor_s = weight_bytes / memory_gb_s / 1e9
    return {"batch": batch, "context": context, "engine_step_ms": 1e3 * step_s, "matmul_step_ms": 1e3 * floor_s,
            "engine_tok_s": batch / step_s, "matmul_tok_s": batch / floor_s, "fraction_of_floor": floor_s / step_s,
            "weights": engine.runner.weights.summary, "step_weight_mb": weight_bytes / 1e6,
            "matmul_gb_s": weight_bytes / floor_s / 1e9, "matmul_gop_s": 2 * weights * batch / floor_s / 1e9,
            "gemm_peak_gop_s": gemm_peak_gop_s(model), "memory_gb_s": memory_gb_s,
            "bandwidth_floor_ms": 1e3 * bandwidth_floor_s, "fraction_of_bandwidth_floor": bandwidth_floor_s / step_s,
            "weights_size_read_gb_s": read_bandwidth_gb_s(weight_bytes)}


def profile_step(model_path: str, batch: int, context: int, seed: int, rows: int = 25) -> str:
    """torch.profiler's table of one batch-B decode step, by self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    llm = _decoding_engine(model_path, batch, context, max_tokens=16, seed=seed)
    llm.engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            llm.engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# -- long prompts to their first token -----------------------------------------------------------
def probe_long_prompt(model_path: str, length: int, seed: int) -> dict:
    from transformers import AutoModelForCausalLM
    from backend import LLM, SamplingParams
    ids = _random_ids(np.random.default_rng(seed), length, _vocab(model_path))
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    row = {"prompt_tokens": length}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for name, budget in (("chunked", 2048), ("unchunked", length)):
        # no prefix reuse: the A B B A rounds send the same ids twice, and the second would be a hit
        llm = LLM(model_path, max_num_batched_tokens=max(budget, 64), cpu_kv_cache_tokens=length + 256,
                  max_num_seqs=1, enable_kv_cache_reuse=False)
        first: list[int] = []

        def engine_first_token() -> None:
            first[:] = llm.generate(ids, params)[0].token_ids

        def hf_forward() -> None:
            with torch.inference_mode():
                hf(torch.tensor([ids])).logits[0, -1]
        hf_forward()
        t_engine, t_hf = interleaved(engine_first_token, hf_forward)
        row[f"engine_{name}_s"], row[f"hf_forward_{name}_s"] = t_engine, t_hf
        row[f"{name}_speedup_vs_hf"] = t_hf / t_engine
        del llm
    return row


def _vocab(model_path: str) -> int:
    from backend.models.loader import load_model_config
    return load_model_config(model_path).vocab_size


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.model_path).is_dir():
        print(f"inflight bench --step-probe: --model-path {args.model_path} is not a folder", file=sys.stderr)
        return 2
    if args.context < 1 or args.steps < 1:
        print("inflight bench --step-probe: --context and --steps must be >= 1", file=sys.stderr)
        return 2
    from backend import EngineConfig
    raw = dict(args.param)
    params = EngineConfig.typed_overrides(raw)
    report: dict = {"model_path": args.model_path, "params": raw, "torch_threads": torch.get_num_threads(),
                    "decode": [], "long_prompts": []}
    print(f"step probe: {args.model_path} {' '.join(f'{k}={v}' for k, v in raw.items())}, context {args.context}")
    print(f"{'batch':>5} {'engine ms':>10} {'matmul ms':>10} {'engine tok/s':>13} {'matmul tok/s':>13} "
          f"{'of floor':>9} {'weights MB':>11} {'GB/s':>6} {'GOP/s':>6} {'peak GOP/s':>11} {'memory GB/s':>12} "
          f"{'bw floor ms':>12} {'of bw floor':>12}")
    for batch in args.batch_sizes:
        row = probe_decode(args.model_path, batch, args.context, args.steps, args.seed, params)
        report["decode"].append(row)
        print(f"{batch:>5} {row['engine_step_ms']:>10.1f} {row['matmul_step_ms']:>10.1f} "
              f"{row['engine_tok_s']:>13.1f} {row['matmul_tok_s']:>13.1f} {row['fraction_of_floor']:>8.0%} "
              f"{row['step_weight_mb']:>11.1f} {row['matmul_gb_s']:>6.1f} {row['matmul_gop_s']:>6.0f} "
              f"{row['gemm_peak_gop_s']:>11.0f} {row['memory_gb_s']:>12.1f} {row['bandwidth_floor_ms']:>12.2f} "
              f"{row['fraction_of_bandwidth_floor']:>11.0%}")
        print(f"      (a buffer the size of the step's weights reads at {row['weights_size_read_gb_s']:.1f} GB/s)")
    if report["decode"]:
        print(f"weights: {report['decode'][0]['weights']}")
    for length in args.long_prompts:
        row = probe_long_prompt(args.model_path, length, args.seed)
        report["long_prompts"].append(row)
        print(f"prompt {length}: engine chunked {row['engine_chunked_s']:.2f} s vs HF forward "
              f"{row['hf_forward_chunked_s']:.2f} s ({row['chunked_speedup_vs_hf']:.2f}x); unchunked "
              f"{row['engine_unchunked_s']:.2f} s vs {row['hf_forward_unchunked_s']:.2f} s "
              f"({row['unchunked_speedup_vs_hf']:.2f}x)")
    report["torch_threads"] = torch.get_num_threads()  # as the engine set them (backend/worker/runner.py)
    print(f"torch threads: {report['torch_threads']}")
    if args.profile:
        print(profile_step(args.model_path, args.profile, args.context, args.seed))
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
