"""What the sampler needs to know of a step on the host, built from its rows' settings with no
device access (sampler.py sends it in two transfers, three when a row has a logit_bias).

`settings` holds a row's numbers, one float64 column each; `index` every (row, token) index the
step needs (penalties, bans, logit biases, allowed tokens), as int64 segments back to back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from backend.core.step import Sampled

# The columns of `settings`: temperature, top_k (vocab when off), top_p, the uniform number (UNIFORM:
# reused by the rejection sampler and the draft), the three penalties, min_p.
TEMP, TOP_K, TOP_P, UNIFORM, REP, FREQ, PRES, MIN_P = range(8)
_SEGMENTS = ("rep", "freq", "counted", "ban", "random", "logprob", "bias", "allowed_rows", "allowed")


@dataclass
class SamplePlan:
    n: int
    settings: np.ndarray          # [N, 8] float64
    index: np.ndarray             # int64: the segments below, back to back
    bias_values: np.ndarray       # float64, one per (row, token) of the bias segment
    random_rows: list[int]
    logprob_rows: list[int]
    freq_rows: list[int]
    rep_count: int
    ban_count: int
    max_top_k: int               # the largest top-k of a random row; vocab when none asks for one
    any_top_p: bool
    any_min_p: bool
    max_top: int
    tops: list[int]               # per logprob row: how many top entries it asked for
    bounds: np.ndarray            # where each segment of `index` starts and ends

    @classmethod
    def build(cls, requests: Sequence, vocab: int) -> "SamplePlan":
        n = len(requests)
        settings = np.zeros((n, 8), dtype=np.float64)
        rep_rows: list[np.ndarray] = []
        rep_toks: list[np.ndarray] = []
        freq_rows, freq_toks, ban_rows, ban_toks = [], [], [], []
        bias_rows, bias_toks, bias_values, allowed_rows, allowed_pairs = [], [], [], [], []
        random_rows, logprob_rows, counted = [], [], []
        for i, req in enumerate(requests):
            p = req.params
            if p.logprobs is not None:
                logprob_rows.append(i)
            if p.penalized:
                settings[i, REP:MIN_P] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                if p.repetition_penalty != 1.0:
                    toks = np.concatenate([req.unique_prompt(), np.asarray(req.output_token_ids, dtype=np.int64)])
                    rep_rows.append(np.full(len(toks), i, dtype=np.int64))
                    rep_toks.append(toks)
                if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
                    counted.append(i)
                    freq_rows += [len(counted) - 1] * len(req.output_token_ids)
                    freq_toks += req.output_token_ids
            if p.biased:
                if p.logit_bias:
                    bias_rows += [i] * len(p.logit_bias)
                    bias_toks += p.logit_bias.keys()
                    bias_values += p.logit_bias.values()
                if p.allowed_token_ids is not None:
                    allowed_rows.append(i)
                    allowed_pairs.append(np.asarray(p.allowed_token_ids, dtype=np.int64))
            banned = banned_tokens(req, vocab)
            ban_rows += [i] * len(banned)
            ban_toks += banned
            if not p.greedy:
                random_rows.append(i)
                top_k = p.top_k if 0 < p.top_k < vocab else vocab
                settings[i, :REP] = (p.temperature, top_k, p.top_p, req.rng.random())
                settings[i, MIN_P] = p.min_p
        rep = (np.concatenate(rep_rows + rep_toks) if rep_rows else np.zeros(0, dtype=np.int64))
        allowed = (np.concatenate([np.full(len(t), r, dtype=np.int64) for r, t in zip(allowed_rows, allowed_pairs)]
                                  + allowed_pairs) if allowed_rows else np.zeros(0, dtype=np.int64))
        segments = [rep, np.asarray(freq_rows + freq_toks, dtype=np.int64), np.asarray(counted, dtype=np.int64),
                    np.asarray(ban_rows + ban_toks, dtype=np.int64), np.asarray(random_rows, dtype=np.int64),
                    np.asarray(logprob_rows, dtype=np.int64), np.asarray(bias_rows + bias_toks, dtype=np.int64),
                    np.asarray(allowed_rows, dtype=np.int64), allowed]
        top_ks = [int(settings[i, TOP_K]) for i in random_rows]
        return cls(n, settings, np.concatenate(segments), np.asarray(bias_values, dtype=np.float64), random_rows,
                   logprob_rows, counted, len(rep) // 2, len(ban_rows),
                   max(top_ks) if top_ks and min(top_ks) < vocab else vocab,
                   any(settings[i, TOP_P] < 1.0 for i in random_rows),
                   any(settings[i, MIN_P] > 0.0 for i in random_rows),
                   max((requests[i].params.logprobs for i in logprob_rows), default=0),
                   [requests[i].params.logprobs for i in logprob_rows], np.cumsum([0] + [len(s) for s in segments]))

    def _slice(self, k: int) -> slice:
        return slice(int(self.bounds[k]), int(self.bounds[k + 1]))

    def segment(self, name: str) -> slice:
        """rep, freq, ban, bias, allowed: rows then tokens; freq's rows are among `counted` (the
        rows with frequency/presence counts); random, logprob, allowed_rows: rows."""
        return self._slice(_SEGMENTS.index(name))

    def has(self, name: str) -> bool:
        s = self.segment(name)
        return s.stop > s.start

    def unpack(self, host: np.ndarray) -> list[Sampled]:
        """The packed read-back: tokens [N], then for the logprob rows L: chosen [L], ranks [L], top
        ids [L, k], top values [L, k]."""
        n, rows, k = self.n, len(self.logprob_rows), self.max_top
        out = [Sampled(int(t)) for t in host[:n]]
        if rows:
            chosen, ranks = host[n:n + rows], host[n + rows:n + 2 * rows]
            top_ids = host[n + 2 * rows:n + 2 * rows + rows * k].reshape(rows, k)
            top_vals = host[n + 2 * rows + rows * k:].reshape(rows, k)
            for j, i in enumerate(self.logprob_rows):
                want = self.tops[j]
                out[i].logprob, out[i].rank = float(chosen[j]), int(ranks[j])
                out[i].top = [(int(t), float(v)) for t, v in zip(top_ids[j, :want], top_vals[j, :want])]
        return out


def banned_tokens(req, vocab: int) -> list[int]:
    """Tokens this request may not sample now: EOS and stop tokens before min_tokens, and the last
    token of every bad word whose other tokens the output ends with."""
    banned = []
    if len(req.output_token_ids) < req.params.min_tokens:
        banned += [*req.eos_token_ids, *req.params.stop_token_ids]
    out = req.output_token_ids
    for word in req.bad_words_ids:
        prefix = word[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix):
            banned.append(word[-1])
    return [t for t in banned if 0 <= t < vocab]
