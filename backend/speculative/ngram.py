"""N-gram proposals (prompt lookup, vLLM's `ngram` method). No torch here.

The longest n-gram of `prompt_lookup_min`..`prompt_lookup_max` tokens that ends the sequence and
also occurs earlier in it (prompt and output) is found; the tokens that followed its earliest
earlier occurrence are proposed, at most `num_speculative_tokens` (fewer when the occurrence is
near the end). Nothing is proposed when no such n-gram exists. These are vLLM's semantics
(vllm/v1/spec_decode/ngram_proposer.py), computed here with numpy: every earlier position that
ends with the sequence's last token is a candidate, and each candidate's match is extended
backwards one token at a time, for at most prompt_lookup_max steps.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max; got {prompt_lookup_min}, "
                             f"{prompt_lookup_max}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most k tokens that followed the longest earlier match of the sequence's last n-gram."""
        total = len(tokens)
        if k <= 0 or total < self.min_n + 1:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        # candidate ends: earlier positions holding the last token (the last position itself excluded)
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)  # matched tokens so far, for each candidate
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, self.max_n):
            back = ends - j
            ok = alive & (back >= 0)
            ok[ok] = seq[back[ok]] == seq[total - 1 - j]
            if not ok.any():
                break
            length[ok] += 1
            alive = ok
        best = int(length.max())
        if best < self.min_n:
            return []
        end = int(ends[np.argmax(length == best)])  # the earliest occurrence among the longest
        return seq[end + 1:end + 1 + k].tolist()
