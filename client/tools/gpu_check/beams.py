"""gpu-check's beam search case (issue 43): beam search through the engine on the GPU, where the
beams' copy-on-write block copies (backend/worker/block_copy.py) run on device KV tensors.

Four beams, all four returned, over a prompt that is not a block multiple (the forked beams copy a
partly filled block). Each returned beam is then scored again without any sharing: its prompt and
tokens fed back as one prompt, the prompt logprobs of its tokens summed (a prefill of its own, no
block shared with anything). The beams must be distinct, their recomputed scores (sum / length,
length_penalty 1) must come best first as the search returned them, and every block must be back
when it ends. A block copied wrong would make a beam's recomputed score differ from the ranking
the search made from the shared blocks. tests/test_beam_search.py checks the beams against
transformers on the CPU.
"""
from __future__ import annotations

WIDTH, MAX_TOKENS = 4, 6
PROMPT = "The story so far, told in a few short words, goes:"


def beam_check(llm, tol: float = 2e-2) -> dict:
    from backend import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(use_beam_search=True, best_of=WIDTH, n=WIDTH, temperature=0.0,
                                                max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    beams = [s.token_ids for s in out.samples]
    prompt = out.prompt_token_ids
    again = llm.generate([prompt + b for b in beams], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    scores = []
    for b, o in zip(beams, again):
        lps = o.prompt_logprobs or []
        if len(lps) != len(prompt) + len(b):
            return dict(ok=False, error=f"prompt_logprobs of {len(lps)} positions, wanted {len(prompt) + len(b)}")
        scores.append(sum(lps[len(prompt) + j][t].logprob for j, t in enumerate(b)) / len(b))
    ordered = all(scores[i] + tol >= scores[i + 1] for i in range(len(scores) - 1))
    stats = llm.stats()
    idle = stats["kv_blocks_used"] == 0 and stats["num_beams_running"] == 0
    distinct = len({tuple(b) for b in beams}) == WIDTH
    return dict(ok=ordered and idle and distinct, distinct=distinct, ordered=ordered, idle=idle,
                prompt_tokens=len(prompt), scores=[round(s, 5) for s in scores], beams=beams)
