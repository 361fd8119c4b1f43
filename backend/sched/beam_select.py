"""Beam search's choice of each step, on numbers only (no torch, no requests): given every live
beam's top log-probabilities, which beams go on with which token, and which finished hypotheses
are kept. The semantics are transformers' `generate(num_beams=N, do_sample=False)` (its
`_beam_search`, read from the source):

- each step the top K = 2N (N with more EOS ids: (1 + #eos) N) candidates over beams x vocabulary
  are ranked by cumulative log-probability (the first step only the first beam's count: the others
  start at -1e9);
- a candidate hits the stop when its token is an EOS id or it reaches max_tokens; those among the
  first N ranks become finished hypotheses, scored sum_logprobs / generated_length**length_penalty,
  and the best N hypotheses are kept;
- the best N candidates that did not hit the stop run on (their cumulative score kept);
- the search ends when every candidate hit the stop (max_tokens), when early_stopping is True and
  N hypotheses are finished, or when the best running beam can no longer beat the worst finished
  one (early_stopping False: at its current length; "never": at max_tokens when length_penalty > 0).
The n returned are the best n hypotheses, best first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

NEG = -1.0e9  # transformers' "impossible" score


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (an EOS last when one ended it) and its score."""
    token_ids: list[int]
    score: float
    eos: bool  # ended by an EOS (else by max_tokens)
    logprobs: list[tuple[float, int]] = field(default_factory=list)  # each token's (logprob, rank in its beam)


@dataclass
class Continuation:
    """A running beam of the next step: the beam it extends, the token, its cumulative score."""
    parent: int
    token: int
    score: float
    logprobs: list[tuple[float, int]] = field(default_factory=list)  # its tokens' (logprob, rank), this one's last


class BeamSearch:
    """One request's beam search state: the running beams' scores and the finished hypotheses."""

    def __init__(self, width: int, max_tokens: int, eos_ids: Sequence[int] = (), length_penalty: float = 1.0,
                 early_stopping: Union[bool, str] = False):
        self.width = width
        self.max_tokens = max_tokens
        self.eos_ids = frozenset(eos_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.keep = max(2, 1 + len(self.eos_ids)) * width  # candidates ranked each step
        self.scores = [0.0] + [NEG] * (width - 1)  # running beams' cumulative log-probabilities
        # N slots of finished hypotheses, best first; an empty slot scores NEG
        self.slots: list[tuple[float, bool, Hypothesis | None]] = [(NEG, False, None)] * width
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied (sticky)
        self.done = False
        self.generated = 0  # tokens each running beam has generated
        self.logprobs: list[list[tuple[float, int]]] = [[] for _ in range(width)]  # each running beam's tokens'

    def step(self, tops: Sequence[Sequence[tuple[int, float]]], histories: Sequence[Sequence[int]]) -> list[Continuation]:
        """One step: tops[b] the (token, logprob) of beam b's best K tokens at least (log_softmax of
        its logits), histories[b] its generated tokens. Returns the N running beams of the next step
        (empty once the search is done)."""
        if self.done:
            raise ValueError("the beam search is done")
        ranks = [{tok: 1 + sum(other > lp for _, other in tops[b]) for tok, lp in tops[b]} for b in range(self.width)]
        raw = {(b, tok): lp for b in range(self.width) for tok, lp in tops[b]}
        cands = sorted(((self.scores[b] + lp, b, tok) for b in range(self.width) for tok, lp in tops[b]),
                       key=lambda c: (-c[0], c[1], c[2]))[:self.keep]
        lps = [self.logprobs[b] + [(raw[b, tok], ranks[b][tok])] for _, b, tok in cands]
        length = self.generated + 1
        hits = [tok in self.eos_ids or length >= self.max_tokens for _, _, tok in cands]
        ranked = sorted(range(len(cands)), key=lambda i: (-(cands[i][0] + NEG * hits[i]), i))[:self.width]
        running = [Continuation(cands[i][1], cands[i][2], cands[i][0] + NEG * hits[i], lps[i]) for i in ranked]
        self._finish(cands, hits, histories, length, lps)
        self.scores = [c.score for c in running]
        self.logprobs = [c.logprobs for c in running]
        self.generated = length
        self._check_done(hits)
        return [] if self.done else running

    def _finish(self, cands, hits, histories, length: int, lps) -> None:
        """Candidates among the first N ranks that hit the stop join the finished slots."""
        full = self.early_stopping is True and all(f for _, f, _ in self.slots)
        merged = list(self.slots)
        for i, (score, beam, tok) in enumerate(cands):
            just = hits[i] and i < self.width
            s = score / (length ** self.length_penalty)
            s += NEG * full + NEG * (not self.improvable) + NEG * (not just)
            hyp = Hypothesis([*histories[beam], tok], s, tok in self.eos_ids, lps[i]) if just else None
            merged.append((s, just, hyp))
        order = sorted(range(len(merged)), key=lambda i: (-merged[i][0], i))[:self.width]
        self.slots = [merged[i] for i in order]

    def _check_done(self, hits) -> None:
        lp, generated = self.length_penalty, self.generated
        best_len = self.max_tokens if self.early_stopping == "never" and lp > 0.0 else generated
        best_running = self.scores[0] / (best_len ** lp)
        worst = min(s for s, _, _ in self.slots)
        self.improvable = self.improvable and any(best_running > (worst if f else NEG) for _, f, _ in self.slots)
        all_finished = all(f for _, f, _ in self.slots)
        self.done = not self.improvable or (all_finished and self.early_stopping is True) or all(hits)

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (only once the search is done)."""
        return [h for _, _, h in self.slots[:n] if h is not None]
