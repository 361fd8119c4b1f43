"""Decode-step time with 0, 1 and N distinct LoRA adapters in the batch (docs/performance.md, issue 27).

    python -m client.tools.benchmarks.lora --model-path models/smollm2-135m-instruct --batch 32 --rank 16

One engine (enable_lora, max_loras = the most adapters asked) with random rank-R adapters on every
projection, written in PEFT's layout, and `batch` requests with `--context`-token prompts, prefilled
and decoding. Then the same running batch steps with each adapter count in turn (0 1 4 4 1 0, step
by step: the adapters dealt round robin to the requests before the step, 0 being the base model),
so a shared machine's load hits every count alike; each figure is the median of its steps. The
report is each count's step against the base step's (0 adapters: the same engine, no LoRA work in
the step). What the tokens are does not matter here, only what the step computes.

`--loop-too` adds, interleaved the same way, each count above 1 on the CPU's loop over segments
(kernels/lora_reference.py) instead of the batched path (backend/worker/lora/cpu_sgmv.py): what decided
which one the engine takes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from templates.render import parse_param

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_path: str, folder: Path, rank: int, seed: int, b_std: float = 0.02) -> Path:
    """A random LoRA adapter of `rank` on every projection, in PEFT's files (adapter_config.json,
    adapter_model.safetensors with PEFT's tensor names)."""
    from safetensors.torch import save_file

    from backend.models.loader import load_model_config
    from backend.models.lora.peft_format import PARENT, shard_sizes

    cfg = load_model_config(model_path)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (fan_in, fan_out) in shard_sizes(cfg).items():
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none",
         "base_model_name_or_path": str(model_path), "task_type": "CAUSAL_LM"}))
    return folder


def run(model_path: str, batch: int, counts: Sequence[int], rank: int, context: int, steps: int, rounds: int,
        seed: int, params: Optional[dict] = None, loop_too: bool = False) -> dict:
    from backend import LLM, SamplingParams
    from backend.worker.lora import cpu_sgmv
    most = max(counts)
    decode = rounds * steps * 2 * (len(counts) + loop_too * len(counts)) + 8  # the steps every request lives through
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {f"lora{i}": write_random_adapter(model_path, Path(tmp) / f"lora{i}", rank, seed + i)
                    for i in range(max(most, 1))}
        llm = LLM(model_path, enable_lora=True, max_loras=max(most, 1), max_lora_rank=rank, max_num_seqs=batch,
                  cpu_kv_cache_tokens=batch * (context + decode + 16), max_num_batched_tokens=max(2048, context),
                  lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()), **(params or {}))
    engine = llm.engine
    rng = np.random.default_rng(seed)
    names = list(adapters)
    kinds = [(c, "batched") for c in counts] + [(c, "loop") for c in counts if loop_too and c > 1]
    order = kinds + kinds[::-1]
    batched_waste = cpu_sgmv.MAX_WASTE
    sampling = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(f"bench-{i}", [int(t) for t in rng.integers(10, engine.vocab_size, context)],
                                   sampling) for i in range(batch)]
    started: set = set()
    while len(started) < batch:  # every request prefilled and decoding
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    engine.step()
    times: dict[tuple[int, str], list[float]] = {k: [] for k in kinds}
    for _ in range(rounds * steps):
        for count, path in order:
            # the same running batch, dealt `count` adapters for this step (what the worker reads: its
            # sequences' adapters, backend/worker/input_batch.py)
            for i, req in enumerate(requests):
                engine.runner.batch[req.seq_id].lora_name = names[i % count] if count else None
            cpu_sgmv.MAX_WASTE = batched_waste if path == "batched" else float("-inf")  # -inf: never batched
            t0 = time.perf_counter()
            engine.step()
            times[(count, path)].append(time.perf_counter() - t0)
    cpu_sgmv.MAX_WASTE = batched_waste
    base = statistics.median(times[kinds[0]])
    rows = [{"adapters": c, "path": path, "step_ms": 1e3 * statistics.median(times[(c, path)]),
             "vs_base": statistics.median(times[(c, path)]) / base, "steps_timed": len(times[(c, path)])}
            for c, path in kinds]
    return {"model": model_path, "batch": batch, "rank": rank, "context": context, "threads": torch.get_num_threads(),
            "rows": rows}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", default="0,1,4", help="adapter counts to compare, the base first (default 0,1,4)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--context", type=int, default=128, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=8, help="rounds of 0 1 4 4 1 0 per --rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop-too", action="store_true", help="also time each count > 1 on the loop over segments")
    p.add_argument("--param", action="append", type=parse_param, default=[], metavar="KEY=VALUE",
                   help="an engine parameter")
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    counts = [int(c) for c in args.adapters.split(",")]
    if counts[0] != 0 or any(c < 0 for c in counts) or args.batch < max(counts):
        p.error("--adapters: counts >= 0, the first 0 (the base), none above --batch")
    from backend.core.config import EngineConfig
    params = EngineConfig.typed_overrides(dict(args.param))
    report = run(args.model_path, args.batch, counts, args.rank, args.context, args.steps, args.rounds, args.seed, params,
                 args.loop_too)
    print(f"{report['model']}: batch {report['batch']}, rank {report['rank']}, context {report['context']}, "
          f"{report['threads']} thread(s)")
    for row in report["rows"]:
        path = " (loop over segments)" if row["path"] == "loop" else ""
        print(f"  {row['adapters']} adapter(s){path}: {row['step_ms']:.1f} ms/step, {row['vs_base']:.2f}x the base step "
              f"({row['steps_timed']} steps)")
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
