"""The KV cache one long request takes (issue 32's cache figure): a Gemma-3-shaped model, five local
sliding-window layers to each global one, against a Llama of the same dimensions (every layer
global), both through the engine's own scheduler and KV-cache groups (backend/kv/groups.py), which
need no model: they are torch-free.

    python -m client.tools.benchmarks.kv_cache_figure                 # 8,192 tokens, window 512, Gemma 3 270M's shape
    python -m client.tools.benchmarks.kv_cache_figure --chunk 2048 --json out.json

One request of `--tokens` tokens (a prompt and `--max-tokens` generated ones) runs alone with a
prefill chunk of `--chunk` tokens (max_num_batched_tokens). At every step the no-evict reservation
(`kv_blocks{state="reserved"}`) and the blocks in use are recorded. The figures are in layer-blocks
(a block of `--block-size` tokens of one layer: a pool block of a KV-cache group is `slots` of them)
and in MiB for the model's KV heads and head size in bf16, so the two layouts compare as memory.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence


def simulate(layer_windows: Sequence[int], num_layers: int, tokens: int, max_tokens: int, block_size: int,
             chunk: int) -> dict:
    """Run one request of `tokens` tokens to its end; the reservation and the use, in layer-blocks."""
    from backend.core.config import EngineConfig
    from backend.kv.groups import KVCacheGroups, kv_layout
    from backend.core.sampling_params import SamplingParams
    from backend.core.request import Request
    from backend.sched.factory import make_scheduler
    from backend.core.step import Sampled

    layout = kv_layout(layer_windows, num_layers)
    cfg = EngineConfig(model_path="unused", kv_block_size=block_size, max_num_seqs=1, max_num_batched_tokens=chunk)
    room = len(layout.group_windows) * -(-tokens // block_size)  # every group all its blocks: never short
    blocks = KVCacheGroups(room, block_size, layout.group_windows, max_prefill_tokens=chunk)
    sched = make_scheduler(cfg, blocks, tokens + 1)
    request = Request("r", [1] * (tokens - max_tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched.add(request)
    reserved: list[int] = []
    used: list[int] = []
    prefill_steps = 0
    while sched.has_work:
        out = sched.schedule(0.0)
        prefill_steps += bool(out.prefills)
        reserved.append(sched.policy.reserved_blocks())
        used.append(blocks.num_used_blocks)
        sched.postprocess(out, {s.request.seq_id: Sampled(7) for s in out.seqs if s.samples}, 0.0)
    scale = layout.slots  # layer-blocks per pool block
    return {"groups": len(layout.group_windows), "slots": layout.slots, "steps": len(used),
            "prefill_steps": prefill_steps, "reserved_at_admission": reserved[0] * scale,
            "reserved_decoding": reserved[-1] * scale, "used_peak": max(used) * scale, "used_at_end": used[-1] * scale}


def figure(tokens: int = 8192, window: int = 512, layers: int = 18, pattern: int = 6, block_size: int = 16,
           chunk: int = 512, max_tokens: int = 16, kv_heads: int = 1, head_dim: int = 256) -> dict:
    """Both layouts' numbers and the Gemma-shaped model's share of the Llama's."""
    gemma = [0 if (i + 1) % pattern == 0 else window for i in range(layers)]
    rows = {"gemma3": simulate(gemma, layers, tokens, max_tokens, block_size, chunk),
            "llama": simulate((), layers, tokens, max_tokens, block_size, chunk)}
    mib = block_size * 2 * kv_heads * head_dim * 2 / 2**20  # K and V, bf16, per layer-block
    keys = ("reserved_at_admission", "reserved_decoding", "used_peak", "used_at_end")
    return {"setup": dict(tokens=tokens, window=window, layers=layers, pattern=pattern, block_size=block_size,
                          chunk=chunk, max_tokens=max_tokens, kv_heads=kv_heads, head_dim=head_dim),
            "layer_blocks": rows, "mib": {m: {k: round(r[k] * mib, 1) for k in keys} for m, r in rows.items()},
            "gemma3_share": {k: round(rows["gemma3"][k] / rows["llama"][k], 3) for k in keys}}


def table(result: dict) -> str:
    rows, mib, share = result["layer_blocks"], result["mib"], result["gemma3_share"]
    lines = ["| | reserved at admission | reserved while decoding | peak in use | in use at the end |",
             "| --- | ---: | ---: | ---: | ---: |"]
    keys = ("reserved_at_admission", "reserved_decoding", "used_peak", "used_at_end")
    for name in ("llama", "gemma3"):
        lines.append(f"| {name} | " + " | ".join(f"{rows[name][k]:,} ({mib[name][k]:,} MiB)" for k in keys) + " |")
    lines.append("| gemma3 / llama | " + " | ".join(f"{share[k]:.3f}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.benchmarks.kv_cache_figure", description=__doc__.split("\n\n")[0])
    for name, default in (("tokens", 8192), ("window", 512), ("layers", 18), ("pattern", 6), ("block-size", 16),
                          ("chunk", 512), ("max-tokens", 16), ("kv-heads", 1), ("head-dim", 256)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", help="write the numbers to this file")
    args = p.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k != "json"}
    if min(values.values()) < 1 or args.max_tokens >= args.tokens:
        p.error("every number must be >= 1, and --max-tokens below --tokens")
    result = figure(**values)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
