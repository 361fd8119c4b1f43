"""transformers' continuous batching runner for the peer comparison, run by the transformers
venv's interpreter (see __init__). Every request gets its own max_new_tokens and no EOS (-1)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_workload, parse_runner_args, warmup_items, write_result  # noqa: E402


def run(manager, items) -> list[int]:
    ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
           for i, (p, n) in enumerate(items)]
    done: dict[str, int] = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            done[result.request_id] = len(result.generated_tokens)
        elif result is None and not manager.is_running():
            raise SystemExit("transformers: the continuous batching loop stopped")
    return [done[i] for i in ids]


def main() -> int:
    args = parse_runner_args(sys.argv[1:])
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    items = load_workload(args.workload)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in items), eos_token_id=-1)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in items),
                          max_generated_length=max(n for _, n in items), num_requests=len(items))
    with model.continuous_batching_context_manager(generation_config=config, workload_hints=hints,
                                                   block=True, timeout=30) as manager:
        run(manager, warmup_items(items, args.warmup))
        t0 = time.perf_counter()
        lens = run(manager, items)
        elapsed = time.perf_counter() - t0
    write_result(args.out, "transformers-cb", elapsed, lens, items)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
