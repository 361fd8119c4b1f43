"""gpu-check's sampling knobs (issue 43): the sampler on the engine's device against a numpy
sampler written from vLLM's definitions, and the knobs through the engine on that device.

`sampler_check`: fixed random logits on the device, each case's rows with their own seeds; every
token must be the numpy reference's drawn with the same uniform number (where they differ, the
uniform must sit on the boundary between the two tokens, within float32 rounding of the device's
softmax). `engine_check`: one engine batch mixing the knobs with structured outputs; each output
checked for what its knob promises; prompt_logprobs of a greedy continuation fed back as a prompt
against the logprobs its decode steps gave. tests/test_sampling_knobs.py runs the same reference
on the CPU.
"""
from __future__ import annotations

import json
import random
from typing import Optional

import numpy as np

VOCAB = 64
ROWS = 200
# Each knob alone and composed (with temperature, top-k, top-p and the penalties).
KNOB_CASES = [
    dict(min_p=0.1), dict(min_p=0.3, temperature=0.7), dict(min_p=0.05, top_k=9, top_p=0.8),
    dict(logit_bias={3: 5.0, 10: -100.0, 11: 2.5}), dict(logit_bias={7: 100.0}, temperature=0.0),
    dict(allowed_token_ids=[2, 5, 9, 40, 63]), dict(allowed_token_ids=[2, 5, 9], temperature=0.0),
    dict(allowed_token_ids=[1, 4, 8, 16, 32], logit_bias={4: 3.0, 8: -1.0}, min_p=0.2, top_k=4),
    dict(logit_bias={0: 4.0, 1: 4.0}, min_p=0.5, frequency_penalty=1.5, presence_penalty=0.5),
]
OUTPUT = [0, 0, 1, 5]  # the rows' output so far (what the penalties count)


def reference_cdf(logits: np.ndarray, p, output=(), mask: Optional[np.ndarray] = None) -> tuple[Optional[int], np.ndarray]:
    """numpy, float64, in vLLM v1's order: grammar mask, allowed tokens, logit bias, frequency and
    presence penalties; greedy: (argmax, the processed logits); else temperature, min_p (p < min_p
    x p_max dropped), top-k, top-p: (None, the cumulative distribution)."""
    x = logits.astype(np.float64).copy()
    if mask is not None:
        x[~mask] = -np.inf
    if p.allowed_token_ids is not None:
        keep = np.zeros(len(x), dtype=bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = -np.inf
    for tok, bias in (p.logit_bias or {}).items():
        x[tok] += bias
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(x))
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.greedy:
        return int(np.argmax(x)), x
    x = x / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    if 0 < p.top_k < len(x):
        x = np.where(x < np.sort(x)[::-1][p.top_k - 1], -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # the mass ranked above each token
        outside = before >= p.top_p
        outside[0] = False  # the most likely token always stays
        probs[order[outside]] = 0.0
    return None, np.cumsum(probs)


def reference_token(logits: np.ndarray, p, u: float, output=(), mask: Optional[np.ndarray] = None) -> int:
    """The token the reference draws with the uniform number u (inverse transform)."""
    greedy, cdf = reference_cdf(logits, p, output, mask)
    return greedy if greedy is not None else int(np.searchsorted(cdf, u * cdf[-1], side="right"))


def _near_tie(logits: np.ndarray, p, u: float, got: int, want: int, tol: float = 1e-4) -> bool:
    """Whether a differing token is float32 rounding: a greedy near-tie, or u on the boundary
    between the two tokens (no mass between them)."""
    greedy, x = reference_cdf(logits, p, OUTPUT)
    if greedy is not None:
        return abs(x[got] - x[want]) <= tol * max(1.0, abs(x[want]))
    lo, hi = sorted((got, want))
    cdf = x / x[-1]
    return abs(u - cdf[lo]) <= tol and cdf[hi - 1] - cdf[lo] <= tol


def sampler_check(device: str) -> dict:
    import torch

    from backend.core.sampling_params import SamplingParams
    from backend.core.step import NewSeq
    from backend.worker.input_batch import SeqState
    from backend.worker.sampler import sample

    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2.0, (ROWS, VOCAB)).astype(np.float32)
    exact = rounding = 0
    wrong = []
    for case in KNOB_CASES:
        rows, params = [], []
        for i in range(ROWS):
            p = SamplingParams(max_tokens=8, seed=1000 + i, **case)
            params.append(p)
            rows.append(SeqState(NewSeq(f"r{i}", [1, 2, 3], list(OUTPUT), p, 0, 0, (), [], None, ((),), 0)))
        got = [s.token for s in sample(torch.from_numpy(logits.copy()).to(device), rows)]  # (changed in place)
        for i, (p, token) in enumerate(zip(params, got)):
            u = random.Random(1000 + i).random()
            want = reference_token(logits[i], p, u, OUTPUT)
            if token == want:
                exact += 1
            elif _near_tie(logits[i], p, u, token, want):
                rounding += 1
            else:
                wrong.append(dict(case=repr(case), row=i, got=token, want=want))
    return dict(ok=not wrong, exact=exact, rounding=rounding, wrong=wrong[:5],
                error=f"{len(wrong)} tokens differ from the numpy sampler" if wrong else "")


def engine_requests(tokenizer, schema: dict) -> tuple[list, list[dict]]:
    """(prompts, the knobs of each request) for engine_check: a bias that forces a token, allowed
    tokens with min_p and the text switches, a stop string kept, a truncated prompt, and a JSON
    schema with a bias and min_p."""
    words = tokenizer.encode(" a the cat dog sat ran on in of", add_special_tokens=False)
    specials = sorted(tokenizer.all_special_ids)
    long_prompt = "one two three four five six seven eight nine ten eleven twelve"
    knobs = [dict(temperature=0.0, max_tokens=6, logit_bias={words[2]: 100.0}, ignore_eos=True),
             dict(temperature=1.0, seed=5, max_tokens=16, min_p=0.1, ignore_eos=True,
                  allowed_token_ids=words + specials, skip_special_tokens=False, spaces_between_special_tokens=False),
             dict(temperature=0.0, max_tokens=16, ignore_eos=True, truncate_prompt_tokens=5,
                  include_stop_str_in_output=True),
             dict(temperature=0.8, seed=9, max_tokens=48, min_p=0.05, logit_bias={words[0]: 2.0},
                  structured_outputs={"json": schema, "disable_any_whitespace": True})]
    return ["Say:", "Words:", long_prompt, "The record:"], knobs


def engine_check(llm, schema: dict, device: str = "cpu") -> dict:
    from backend import SamplingParams

    tok = llm.tokenizer
    prompts, knobs = engine_requests(tok, schema)
    outs = llm.generate(prompts, [SamplingParams(**k) for k in knobs])
    forced, allowed, truncated, structured = outs
    checks = {
        "logit_bias": forced.token_ids == [next(iter(knobs[0]["logit_bias"]))] * 6,
        "allowed_token_ids": set(allowed.token_ids) <= set(knobs[1]["allowed_token_ids"])
        and allowed.text == tok.decode(allowed.token_ids, skip_special_tokens=False),
        "truncate_prompt_tokens": truncated.prompt_token_ids == tok.encode(prompts[2])[-5:],
    }
    try:
        value = json.loads(structured.text)
        checks["with_structured_outputs"] = isinstance(value, dict) and set(value) == set(schema["required"])
    except ValueError:
        checks["with_structured_outputs"] = False
    checks["prompt_logprobs"], gap = _prompt_logprobs_check(llm, 1e-3 if device == "cpu" else 0.1)
    failed = [k for k, ok in checks.items() if not ok]
    return dict(ok=not failed, checks=checks, prompt_logprobs_gap=gap,
                error=f"failed: {', '.join(failed)}" if failed else "")


def _prompt_logprobs_check(llm, tol: float) -> tuple[bool, float]:
    """The prefill's prompt logprobs of a greedy continuation, fed back as a prompt, against the
    logprobs the decode steps gave its tokens (prefill and decode kernels: within `tol`)."""
    from backend import SamplingParams

    first = llm.generate(["The story so far:"], SamplingParams(temperature=0.0, max_tokens=6, logprobs=0,
                                                               ignore_eos=True))[0]
    n = len(first.prompt_token_ids)
    again = llm.generate([first.prompt_token_ids + first.token_ids],
                         SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    if again.prompt_logprobs is None or len(again.prompt_logprobs) != n + 6:
        return False, float("inf")
    gap = max(abs(again.prompt_logprobs[n + j][t].logprob - first.logprobs[j][t].logprob)
              for j, t in enumerate(first.token_ids))
    return gap <= tol, gap
