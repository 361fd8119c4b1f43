"""Per-sequence grammar state, and the bitmask of a step: planned on the scheduler's side, applied
by the worker's sampler.

Each constrained sequence (each of a request's n completions) owns a `GrammarState`: an xgrammar
matcher advanced by every token the scheduler appends (`advance`, called from its postprocess), so
it always stands after the sequence's last output token. A preempted sequence keeps its output
tokens and is recomputed from them (max_utilization), so its matcher needs no rollback.

`step_masks` fills, as the step is planned, the bitmask of every constrained row that samples (one
batched call of xgrammar's, on as many threads as the cores this process may use, at most
FILL_THREADS), and the plan carries it to the worker (backend/core/step.py `GrammarMasks`); the
sampler applies it after the raw log_softmax (logprobs stay those of the raw logits, as vLLM's)
and before penalties and sampling (backend/worker/sampler.py). Rows without a constraint share the
step untouched.

A request ends ("stop") when its grammar is complete and admits nothing more than its end: that is
checked as soon as the token that completes it is appended, so the request ends then, without a
step spent sampling the EOS (its output does not end with an EOS token) and whatever min_tokens or
ignore_eos say. When the grammar is complete but may go on (a regex `a+`), the model chooses: EOS
(banned before min_tokens, as always) ends it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Optional, Sequence

from backend.core.request import RequestStatus
from backend.core.step import GrammarMasks

if TYPE_CHECKING:  # torch and xgrammar load with the first constrained request
    import torch

    from backend.core.request import Request
    from backend.core.structured import CompiledConstraint
    from backend.sched.batch import ScheduledSeq

FILL_THREADS = 8  # the most threads filling a step's bitmasks (at most one per core this process may use)


class GrammarState:
    __slots__ = ("compiled", "matcher", "stop_token_ids", "_next_mask")

    def __init__(self, compiled: "CompiledConstraint", stop_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.compiled = compiled
        self.stop_token_ids = tuple(stop_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self._next_mask: Optional["torch.Tensor"] = None  # filled early by advance(), used by the next step

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

    def copy_ready_mask(self, bitmask: "torch.Tensor", row: int) -> bool:
        """Write the next mask into row `row` if `advance` already computed it; whether it did."""
        if self._next_mask is None:
            return False
        bitmask[row] = self._next_mask
        return True


def step_masks(rows: Sequence["ScheduledSeq"]) -> Optional[GrammarMasks]:
    """The bitmask of each row of `rows` that samples under a constraint (None when none does): the
    tokens its grammar allows next, filled in one batched call."""
    requests = [s.request for s in rows if s.request.grammar is not None and s.samples]
    if not requests:
        return None
    bitmask = xgr_bitmask(len(requests), requests[0].grammar.compiled.vocab_size)
    to_fill = [i for i, r in enumerate(requests) if not r.grammar.copy_ready_mask(bitmask, i)]
    if to_fill:  # one call, on several threads: the model is not running meanwhile
        _batch_matcher().batch_fill_next_token_bitmask([requests[i].grammar.matcher for i in to_fill],
                                                       bitmask, to_fill)
    return GrammarMasks([r.seq_id for r in requests], bitmask.numpy())


@lru_cache(maxsize=1)
def _batch_matcher():
    """xgrammar's batch matcher on the cores this process may use: counted as they were before the
    engine pinned its threads (os.sched_getaffinity would then say one)."""
    import xgrammar as xgr

    from kernels.cpuinfo import allowed_cores
    return xgr.BatchGrammarMatcher(max_threads=min(FILL_THREADS, len(allowed_cores())))


def xgr_bitmask(rows: int, vocab_size: int) -> "torch.Tensor":
    """A bitmask of `rows` rows that allows every token (xgrammar's layout: int32 words)."""
    import xgrammar as xgr
    return xgr.allocate_token_bitmask(rows, vocab_size)


def allows_more_than(row: "torch.Tensor", stop_token_ids: Sequence[int]) -> bool:
    """Whether a bitmask row allows any token besides the stop tokens."""
    import numpy as np

    words = row.numpy().view(np.uint32).copy()
    for t in stop_token_ids:
        words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return bool(words.any())
