"""gpu-check's greedy part: the engine's greedy tokens against transformers, teacher-forced.

The engine (on cuda:N, the machine's last GPU, dtype auto: bfloat16 for this bf16 checkpoint) runs
greedy at batch 1 (one long prompt), 64 and 256. transformers then reads each sequence (prompt and
the engine's tokens) once in the engine's dtype and once in float32, on the same GPU and weights,
and gives the logits that chose each token. At every position the engine's token must be the
reference's argmax, or within rounding of it: the reference's top logit minus its logit of the
engine's token (the gap) at most `tolerance(top)`. After a legitimate flip the texts differ, and
teacher forcing keeps checking on the engine's own path.

The tolerance is the dtype's rounding at the logit's magnitude, not a constant: a bf16 logit of
26-35 is stored with a step (ulp) of 0.125-0.25, so a fixed 0.125 fails a correct engine. In ulps
of the top logit, `ulps(layers)`:
- ROUNDING_ULPS (2): the engine's and the reference's logits are each rounded to the dtype, half
  an ulp per logit, and the gap takes two logits from each;
- HIDDEN_ULPS_PER_SQRT_LAYER (6) x sqrt(layers): the hidden state reaching the LM head carries the
  rounding of every layer, in a different order in each implementation (kernel tiling, fused ops),
  a random walk that grows like the square root of the depth. Measured on the check's model (16
  layers, CPU): transformers bf16 against float32 leaves the final hidden state 2.6% off on
  average (3.5% at most) and moves a gap by up to 5.8 ulps over 1k positions; simulated over 10k
  positions with 3.5% in the reference and twice that in the engine, gaps reach 18-23 ulps
  (docs/performance.md, "gpu-check's greedy tolerance"). 16 layers: 2 + 24 = 26 ulps, 3.25 at a
  logit of 26; a wrong layer moves thousands of positions past it.
The same-dtype reference decides (two implementations of the same arithmetic); the float32 column
is reported beside it, judged by the same tolerance. tests/test_greedy_tolerance.py simulates the
check over 10k positions at this model's logit magnitudes: it passes a correct bf16 engine and
fails one with a wrong layer.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Optional

import torch

MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}
ROUNDING_ULPS = 2
HIDDEN_ULPS_PER_SQRT_LAYER = 6


def ulps(layers: int) -> float:
    """The tolerance in ulps of the top logit for a model of this depth."""
    return ROUNDING_ULPS + HIDDEN_ULPS_PER_SQRT_LAYER * math.sqrt(layers)


def ulp(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The spacing of `dtype`'s values at |x| (float32 tensor): 2^(exponent - mantissa bits)."""
    bits = MANTISSA_BITS[dtype]
    exponent = torch.floor(torch.log2(x.abs().float().clamp_min(2.0 ** -14)))
    return torch.exp2(exponent - bits)


def tolerance(top: torch.Tensor, dtype: str, layers: int) -> torch.Tensor:
    """The largest gap rounding explains at a position whose top logit is `top`."""
    return ulps(layers) * ulp(top, dtype)


def judge(logits: torch.Tensor, tokens: torch.Tensor, dtype: str, layers: int) -> dict:
    """One sequence: `logits` [T, V] the reference's (any float dtype) at the positions that chose
    `tokens` [T], the engine's. Counts, the largest gap (and in ulps), the positions over the
    tolerance, and the first position where the tokens differ with the two logits."""
    logits = logits.float()
    top = logits.max(-1)
    mine = logits.gather(1, tokens[:, None].long())[:, 0]
    gap = top.values - mine                                   # 0 where the engine took the argmax
    units = ulp(top.values, dtype)
    limit = ulps(layers)
    over = gap > limit * units
    differ = (tokens != top.indices).nonzero()
    first = None
    if len(differ):
        i = int(differ[0, 0])
        first = dict(position=i, engine_token=int(tokens[i]), reference_token=int(top.indices[i]),
                     engine_token_logit=float(mine[i]), reference_top_logit=float(top.values[i]),
                     gap=float(gap[i]), tolerance=float(limit * units[i]))
    return dict(positions=int(tokens.numel()), exact=int((gap == 0).sum()), over=int(over.sum()),
                max_gap=float(gap.max()) if tokens.numel() else 0.0,
                max_gap_ulps=float((gap / units).max()) if tokens.numel() else 0.0, first_diff=first)


def merge(rows: list[dict]) -> dict:
    """Sequences' judgements -> one (the first difference is the first sequence's that has one)."""
    firsts = [dict(r["first_diff"], sequence=i) for i, r in enumerate(rows) if r["first_diff"]]
    return dict(positions=sum(r["positions"] for r in rows), exact=sum(r["exact"] for r in rows),
                over=sum(r["over"] for r in rows), max_gap=max((r["max_gap"] for r in rows), default=0.0),
                max_gap_ulps=max((r["max_gap_ulps"] for r in rows), default=0.0),
                first_diff=firsts[0] if firsts else None, ok=sum(r["over"] for r in rows) == 0)


def batch_lengths(rng: random.Random, batch: int, low: int, high: int) -> list[int]:
    """Prompt lengths for a batch: log-uniform in [low, high], never block multiples only."""
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(batch)]


def greedy(plan: dict, model_dir: Path, device: str) -> dict:
    from backend import LLM, SamplingParams

    rng = random.Random(5)
    batches = [(b, batch_lengths(rng, b, low, high)) for b, low, high in plan["greedy_batches"]]
    start = time.monotonic()
    llm = LLM(str(model_dir), device=device, attention_backend=plan["attention_backend"],
              max_num_seqs=max(b for b, _ in batches), max_num_batched_tokens=plan["max_num_batched_tokens"],
              max_model_len=plan["max_model_len"])
    runner = llm.engine.runner
    dtype = str(runner.dtype).replace("torch.", "")
    engine_info = dict(device=str(runner.device), dtype=dtype, kernels=runner.ops.name,
                       graphs=bool(runner.decode_path.graphs and runner.decode_path.graphs.graphs), kv_blocks=runner.num_blocks,
                       start_s=round(time.monotonic() - start, 1))
    vocab, layers = llm.engine.vocab_size, llm.engine.model_config.num_layers
    runs = []
    for b, lengths in batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
        t0 = time.monotonic()
        outs = llm.generate(prompts, SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True))
        runs.append((b, prompts, [list(o.token_ids) for o in outs], time.monotonic() - t0))
    llm.close()
    del llm, runner
    free(device)
    references = {name: _reference(model_dir, device, name) for name in dict.fromkeys((dtype, "float32"))}
    results = []
    for b, prompts, outputs, seconds in runs:
        row = dict(batch=b, prompt_tokens=[min(map(len, prompts)), max(map(len, prompts))],
                   tokens=sum(map(len, outputs)), engine_s=round(seconds, 2),
                   complete=all(len(o) == plan["max_tokens"] for o in outputs))
        for name, hf in references.items():
            row[name] = merge([judge(_teacher_forced(hf, p, o, device), torch.tensor(o, device=device), dtype, layers)
                               for p, o in zip(prompts, outputs)])
        row["ok"] = row["complete"] and row[dtype]["ok"]
        results.append(row)
    del references
    free(device)
    side = {}   # plan["greedy_cases"]: images (Gemma 3's encoder and mask) and embeddings (the pooled rows)
    if "vision" in plan["greedy_cases"]:
        from client.tools.gpu_check.vision import vision_check
        side["vision"] = vision_check(plan, model_dir.parent, device)
        free(device)
    if "pooling" in plan["greedy_cases"]:
        from client.tools.gpu_check.pooling import pooling_check
        side["pooling"] = pooling_check(plan, model_dir.parent, device)
        free(device)
    ok = all(r["ok"] for r in results) and dtype == plan["expected_dtype"] and engine_info["device"] == device
    ok = ok and all(case["ok"] for case in side.values())
    return dict(ok=ok, dtype=dtype, ulps=ulps(layers), oracle=f"transformers {dtype} (decides) and "
                "float32", engine=engine_info, expected_dtype=plan["expected_dtype"], batches=results, **side)


def _reference(model_dir: Path, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()


def _teacher_forced(hf, prompt: list[int], output: list[int], device: str) -> torch.Tensor:
    """The reference's logits [len(output), V] that chose each output token."""
    ids = torch.tensor([prompt + output], device=device)
    with torch.no_grad():   # only the positions that chose a token: a 16k prompt's logits are not kept
        return hf(ids, logits_to_keep=len(output) + 1).logits[0, :-1]


def free(device: Optional[str]) -> None:
    import gc

    gc.collect()
    if device and device.startswith("cuda"):
        torch.cuda.empty_cache()
