"""gpu-check's tensor-parallel part (client/tools/gpu_check/run.py runs it in its own process).

With two GPUs or more: the engine at tensor_parallel_size 2 (NCCL, ranks on cuda:0 and cuda:1)
against the same engine on cuda:0 alone, greedy on 16 prompts: the tokens must match, or differ
first where the one-rank engine's top two logprobs are within the plan's near-tie (bf16 and the
all-reduce's summation order move logits by a rounding step); then the decode step time of each,
the all-reduces a step makes, and no worker process left once the engine is closed. With fewer
GPUs it is skipped, and says so (the dry run on the CPU takes that path).
"""
from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

PROMPTS, DECODE_STEPS = 16, 10


def tensor_parallel(plan: dict, model_dir: Path) -> dict:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return dict(ok=True, skipped=f"the TP=2 run (NCCL) needs two GPUs; this machine has {gpus}")
    from backend import LLM, SamplingParams
    from backend.worker.parallel.launcher import worker_processes

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(20, 300))] for _ in range(PROMPTS)]
    params = SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for tp in (1, 2):
        start = time.monotonic()
        llm = LLM(str(model_dir), device="cuda:0", tensor_parallel_size=tp, max_num_seqs=PROMPTS,
                  max_num_batched_tokens=plan["max_num_batched_tokens"], max_model_len=plan["max_model_len"])
        try:
            load_s = time.monotonic() - start
            outs = llm.generate(prompts, params)
            runs[tp] = dict(outs=outs, load_s=round(load_s, 1), step_ms=_decode_step_ms(llm, prompts),
                            graphs=bool(llm.engine.runner.decode_path.graphs and llm.engine.runner.decode_path.graphs.graphs),
                            tp_stats=llm.engine.runner.tp.stats() if llm.engine.runner.tp else None)
        finally:
            llm.close()
            del llm
            torch.cuda.empty_cache()
    left = [" ".join(p.cmdline()) for p in worker_processes()]
    same, flips, bad = 0, [], []
    for a, b in zip(runs[1]["outs"], runs[2]["outs"]):
        if a.token_ids == b.token_ids:
            same += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top_two = a.logprobs[i]
        gap = abs(float(torch.tensor([lp.logprob for lp in top_two.values()]).diff()[0]))
        (flips if b.token_ids[i] in top_two and gap <= plan["tp_near_tie"] else bad).append(dict(position=i, gap=gap))
    ok = not bad and not left and len(runs[2]["outs"]) == PROMPTS
    return dict(ok=ok, gpus=gpus, prompts=PROMPTS, same=same, near_tie_flips=flips, not_near_tie=bad,
                near_tie=plan["tp_near_tie"], workers_left=left,
                tp1=dict(step_ms=runs[1]["step_ms"], load_s=runs[1]["load_s"], graphs=runs[1]["graphs"]),
                tp2=dict(step_ms=runs[2]["step_ms"], load_s=runs[2]["load_s"], graphs=runs[2]["graphs"],
                         collectives=runs[2]["tp_stats"]),
                error=None if ok else f"{len(bad)} prompts diverged away from a near-tie; workers left: {left}")


def _decode_step_ms(llm, prompts) -> float:
    """The median decode step of all prompts together (LLMEngine.step, sampling included)."""
    from backend import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=DECODE_STEPS + 4, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"step-{i}", p, params) for i, p in enumerate(prompts)]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    times = []
    for _ in range(DECODE_STEPS):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for r in reqs:
        engine.abort(r.request_id)
    return statistics.median(times) * 1e3
