"""Per-sequence grammar state, and the one batched mask of a step.

Each constrained sequence (each of a request's n completions) owns a `GrammarState`: an xgrammar
matcher advanced by every token the scheduler appends (`advance`, called from its postprocess), so
it always stands after the sequence's last output token. A preempted sequence keeps its output
tokens and is recomputed from them (max_utilization), so its matcher needs no rollback.

`apply_grammar_masks` runs in the sampler after the raw log_softmax (logprobs stay those of the raw
logits, as vLLM's) and before penalties and sampling: one bitmask for the step's rows, filled for the
constrained rows only (one batched call of xgrammar's, on several threads), and one
`apply_token_bitmask_inplace` over those rows. Rows without a constraint share the step untouched.

A request ends ("stop") when its grammar is complete and admits nothing more than its end: that is
checked as soon as the token that completes it is appended, so the request ends then, without a
step spent sampling the EOS (its output does not end with an EOS token) and whatever min_tokens or
ignore_eos say. When the grammar is complete but may go on (a regex `a+`), the model chooses: EOS
(banned before min_tokens, as always) ends it.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

from backend.core.request import RequestStatus

if TYPE_CHECKING:
    from backend.core.request import Request
    from backend.core.structured import CompiledConstraint

FILL_THREADS = 8  # the most threads filling a step's bitmasks (at most one per core this process may use)


class GrammarState:
    __slots__ = ("compiled", "matcher", "stop_token_ids", "_next_mask")

    def __init__(self, compiled: "CompiledConstraint", stop_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.compiled = compiled
        self.stop_token_ids = tuple(stop_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self._next_mask: Optional[torch.Tensor] = None  # filled early by advance(), used by the next step

    def sibling(self) -> "GrammarState":
        """A fresh state on the same grammar, for another completion of the same prompt."""
        return GrammarState(self.compiled, self.stop_token_ids)

    def advance(self, request: "Request", token: int) -> Optional[RequestStatus]:
        """Take the token just appended to the request's output; the status that ends the request
        now, or None while it goes on."""
        self._next_mask = None
        if not self.matcher.accept_token(token):
            # Only when a ban of the sampler's (bad_words, min_tokens) removed every token the
            # grammar allowed: the sampler then had nothing left to choose from.
            request.error = (f"structured outputs: token {token} does not follow the constraint (every token "
                             "it allowed here was banned by bad_words or min_tokens)")
            return RequestStatus.FINISHED_ERROR
        if self.matcher.is_terminated():  # it took a stop token
            return RequestStatus.FINISHED_STOPPED
        if self.matcher.is_completed():
            mask = xgr_bitmask(1, self.compiled.vocab_size)
            self.matcher.fill_next_token_bitmask(mask, 0)
            if not allows_more_than(mask[0], self.stop_token_ids):
                return RequestStatus.FINISHED_STOPPED
            self._next_mask = mask[0]
        return None

    def copy_ready_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the next mask into row `row` if `advance` already computed it; whether it did."""
        if self._next_mask is None:
            return False
        bitmask[row] = self._next_mask
        return True


def apply_grammar_masks(logits: torch.Tensor, requests: Sequence["Request"]) -> None:
    """Mask, in place and in one batched operation, the logits of every row whose request has a
    grammar to tokens the grammar allows next. logits [N, V], one row per request."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr_bitmask(len(requests), logits.shape[-1])
    to_fill = [i for i in rows if not requests[i].grammar.copy_ready_mask(bitmask, i)]
    if to_fill:  # one call, on several threads: the model is not running meanwhile
        _batch_matcher().batch_fill_next_token_bitmask([requests[i].grammar.matcher for i in to_fill],
                                                       bitmask, to_fill)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


@lru_cache(maxsize=1)
def _batch_matcher():
    import xgrammar as xgr
    return xgr.BatchGrammarMatcher(max_threads=min(FILL_THREADS, len(os.sched_getaffinity(0))))


def xgr_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of `rows` rows that allows every token (xgrammar's layout: int32 words)."""
    import xgrammar as xgr
    return xgr.allocate_token_bitmask(rows, vocab_size)


def allows_more_than(row: torch.Tensor, stop_token_ids: Sequence[int]) -> bool:
    """Whether a bitmask row allows any token besides the stop tokens."""
    words = row.numpy().view(np.uint32).copy()
    for t in stop_token_ids:
        words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return bool(words.any())
