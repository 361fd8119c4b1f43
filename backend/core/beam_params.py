"""Beam search's request settings, checked (SamplingParams.validate calls `check_beams`): vLLM's
use_beam_search, best_of (the beam width; n when unset), length_penalty and early_stopping
(true | false | "never", as transformers' generate), and what beam search does not compose with.
No torch here; the search itself is backend/sched/beams.py."""
from __future__ import annotations

import math
from typing import Any

MAX_BEAM_WIDTH = 16  # beams of one request (each a sequence: max_num_seqs bounds it too)
GREEDY_BELOW = 1e-5  # (sampling_params.GREEDY_BELOW)
# what beam search does not compose with: field -> its neutral value (vLLM refused the same)
NOT_WITH_BEAMS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "min_tokens": 0,
                  "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                  "logit_bias": None, "allowed_token_ids": None, "bad_words": [], "stop": [],
                  "logprobs": None, "prompt_logprobs": None, "structured_outputs": None}


def check_beams(p: Any) -> None:
    """Raise ValueError naming the field of a SamplingParams `p` whose beam settings are wrong."""
    if p.early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be true, false or \"never\"; got {p.early_stopping!r}")
    lp = p.length_penalty
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
        raise ValueError(f"length_penalty must be a finite number; got {lp!r}")
    if not p.use_beam_search:
        if p.best_of is not None and p.best_of != p.n:
            raise ValueError(f"best_of ({p.best_of}) other than n ({p.n}) needs use_beam_search: best_of is "
                             f"the beam width here (sampling n of best_of is not served)")
        return
    width = p.beam_width
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_BEAM_WIDTH:
        raise ValueError(f"best_of must be an integer in [1, {MAX_BEAM_WIDTH}] (the beam width); got {width!r}")
    if p.n > width:
        raise ValueError(f"n ({p.n}) must not exceed the beam width (best_of = {width})")
    for name, neutral in NOT_WITH_BEAMS.items():
        value = getattr(p, name)
        if name == "temperature" and value < GREEDY_BELOW or name == "top_k" and value == -1 \
                or name == "logprobs" and value == 0:  # each beam token's own logprob (not the top k)
            continue
        if value != neutral:
            raise ValueError(f"{name} ({value!r:.80}) is not supported with beam search (send {neutral!r}): "
                             f"beams rank the raw log-probabilities (temperature 0, as vLLM's beam search and "
                             f"transformers' num_beams with do_sample=False)")
