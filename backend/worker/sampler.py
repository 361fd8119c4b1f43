"""Turn logits into tokens: grammar masks, penalties, bad words, min_tokens, greedy, temperature,
top-k, top-p, and the logprobs a request asked for. Stateless: every per-sequence state (random
stream, tokens, settings) is the worker's `SeqState` (input_batch.py); a step's grammar bitmask
comes with its plan (backend/core/step.py).

The rows that sample are handled together, as tensors (temperature, top-k, top-p per row), and each
draws its token by inverse transform from one uniform number of the sequence's own seeded stream,
so its tokens do not depend on its batch. Logprobs are vLLM v1's: log_softmax of the raw logits,
before penalties and temperature.

On a GPU a step's sampling costs the host two transfers (the per-row settings; every (row, token)
index of the penalties and bans) and one read back (tokens and logprobs, packed): none per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from backend.core.step import Sampled
from backend.worker.device import to_device

# A step's grammar masks: (the logits rows they apply to, their bitmask rows [len(rows), words])
Masks = Optional[tuple[list[int], np.ndarray]]

# Per-row settings, the columns of one float64 array: temperature, top_k (vocab when off), top_p, the
# uniform number (UNIFORM: reused by the rejection sampler and the draft), the three penalties.
_TEMP, _TOP_K, _TOP_P, _U, _REP, _FREQ, _PRES = range(7)
UNIFORM = _U


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [N] int64, the first of equal maxima (as torch's). On the CPU through
    numpy's, whose vectorized scan is ~25x torch's there (3 against 80 us over a 49,152-token
    vocabulary: 2% of a batch-1 step of SmolLM2)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        tokens = torch.empty(logits.shape[0], dtype=torch.int64)
        np.argmax(logits.contiguous().numpy(), axis=-1, out=tokens.numpy())
        return tokens
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, requests: Sequence, masks: Masks = None) -> list[Sampled]:
    """logits [N, V] float32, a row per sequence (modified in place); N results. `masks`: grammar's."""
    vocab = logits.shape[-1]
    if masks is None and all(_argmax_of_raw_logits(r, vocab) for r in requests):
        # The common step (every row plain greedy) skips the plan, its two transfers and the packed
        # read back, which cost ~10x the argmax itself: 2-3% of a batch-1 CPU decode step.
        return [Sampled(t) for t in greedy_tokens(logits).tolist()]
    prep = prepare(logits, requests, masks)
    tokens = greedy_tokens(logits)
    if prep.plan.random_rows:
        rows = prep.random_rows
        probs = filtered_probs(logits[rows], prep.settings[rows], prep.plan)
        tokens[rows] = inverse_transform(probs, prep.settings[rows, _U])
    return prep.read_back(tokens)[0]


def _argmax_of_raw_logits(req, vocab: int) -> bool:
    """Whether this row's token is its logits' argmax as they stand: greedy, no logprobs, no
    penalties, nothing banned now (what prepare() would change; a step's grammar mask aside)."""
    p = req.params
    if not p.greedy or p.logprobs is not None or p.penalized:
        return False
    if not req.bad_words_ids and (len(req.output_token_ids) >= p.min_tokens
                                  or not (req.eos_token_ids or p.stop_token_ids)):
        return True  # (the common case, without building the list of bans)
    return not _banned(req, vocab)


@dataclass
class Prepared:
    """A step's logits after everything but the draw: the plan, its settings and index on the
    device, and the raw logprobs of the rows that asked (before the grammar, penalties and bans,
    which are applied to the logits in place)."""
    plan: "_Plan"
    settings: torch.Tensor
    index: torch.Tensor
    raw: Optional[torch.Tensor]

    @property
    def random_rows(self) -> torch.Tensor:
        return self.index[self.plan.random_slice]

    def read_back(self, tokens: torch.Tensor, extra: Sequence[torch.Tensor] = ()) -> tuple[list[Sampled], np.ndarray]:
        """The step's one read back: every row's token, the logprobs asked for, and `extra` (flat
        tensors, returned as one float64 array after the Sampled results)."""
        plan = self.plan
        parts = [tokens.double()]
        if self.raw is not None:
            parts += _logprobs(self.raw, tokens[self.index[plan.logprob_slice]], plan.max_top)
        parts += [e.double().flatten() for e in extra]
        host = torch.cat(parts).cpu().numpy()
        tail = sum(e.numel() for e in extra)
        return plan.unpack(host[:len(host) - tail]), host[len(host) - tail:]


def prepare(logits: torch.Tensor, requests: Sequence, masks: Masks = None) -> Prepared:
    """Raw logprobs, then grammar masks, penalties and bans on logits [N, V] in place, one row per
    sequence (or per position of a speculating row: backend/worker/rejection.py)."""
    n, vocab = logits.shape
    plan = _Plan.build(requests, vocab)
    dev = logits.device
    settings = to_device(plan.settings, dev)
    index = to_device(plan.index, dev)
    raw = torch.log_softmax(logits[plan.logprob_rows].float(), dim=-1) if plan.logprob_rows else None
    if masks is not None:  # structured outputs: after the raw logprobs, before everything else
        apply_masks(logits, *masks)
    if plan.rep_count:
        _repetition(logits, index[plan.rep_slice], settings)
    if plan.freq_rows:
        _frequency_presence(logits, index[plan.freq_slice], index[plan.counted_slice], settings)
    if plan.ban_count:
        banned = index[plan.ban_slice].view(2, -1)
        logits[banned[0], banned[1]] = float("-inf")
    return Prepared(plan, settings, index, raw)


@dataclass
class _Plan:
    """What sample() needs to know on the host, built from the requests with no device access."""
    n: int
    settings: np.ndarray          # [N, 7] float64
    index: np.ndarray             # int64: the segments below, back to back
    random_rows: list[int]
    logprob_rows: list[int]
    freq_rows: list[int]
    rep_count: int
    ban_count: int
    max_top_k: int               # the largest top-k of a random row; vocab when none asks for one
    any_top_p: bool
    max_top: int
    tops: list[int]               # per logprob row: how many top entries it asked for
    bounds: np.ndarray            # where each segment of `index` starts and ends

    @classmethod
    def build(cls, requests: Sequence, vocab: int) -> "_Plan":
        n = len(requests)
        settings = np.zeros((n, 7), dtype=np.float64)
        rep_rows: list[np.ndarray] = []
        rep_toks: list[np.ndarray] = []
        freq_rows, freq_toks, ban_rows, ban_toks = [], [], [], []
        random_rows, logprob_rows, counted = [], [], []
        for i, req in enumerate(requests):
            p = req.params
            if p.logprobs is not None:
                logprob_rows.append(i)
            if p.penalized:
                settings[i, _REP:] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                if p.repetition_penalty != 1.0:
                    toks = np.concatenate([req.unique_prompt(), np.asarray(req.output_token_ids, dtype=np.int64)])
                    rep_rows.append(np.full(len(toks), i, dtype=np.int64))
                    rep_toks.append(toks)
                if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
                    counted.append(i)
                    freq_rows += [len(counted) - 1] * len(req.output_token_ids)
                    freq_toks += req.output_token_ids
            banned = _banned(req, vocab)
            ban_rows += [i] * len(banned)
            ban_toks += banned
            if not p.greedy:
                random_rows.append(i)
                top_k = p.top_k if 0 < p.top_k < vocab else vocab
                settings[i, :_REP] = (p.temperature, top_k, p.top_p, req.rng.random())
        rep = (np.concatenate(rep_rows + rep_toks) if rep_rows else np.zeros(0, dtype=np.int64))
        segments = [rep, np.asarray(freq_rows + freq_toks, dtype=np.int64), np.asarray(counted, dtype=np.int64),
                    np.asarray(ban_rows + ban_toks, dtype=np.int64), np.asarray(random_rows, dtype=np.int64),
                    np.asarray(logprob_rows, dtype=np.int64)]
        top_ks = [int(settings[i, _TOP_K]) for i in random_rows]
        return cls(n, settings, np.concatenate(segments), random_rows, logprob_rows, counted,
                   len(rep) // 2, len(ban_rows), max(top_ks) if top_ks and min(top_ks) < vocab else vocab,
                   any(settings[i, _TOP_P] < 1.0 for i in random_rows),
                   max((requests[i].params.logprobs for i in logprob_rows), default=0),
                   [requests[i].params.logprobs for i in logprob_rows], np.cumsum([0] + [len(s) for s in segments]))

    def _slice(self, k: int) -> slice:
        return slice(int(self.bounds[k]), int(self.bounds[k + 1]))

    rep_slice = property(lambda self: self._slice(0))        # rows then tokens
    freq_slice = property(lambda self: self._slice(1))       # rows (among the counted) then tokens
    counted_slice = property(lambda self: self._slice(2))    # the rows with frequency/presence counts
    ban_slice = property(lambda self: self._slice(3))        # rows then tokens
    random_slice = property(lambda self: self._slice(4))
    logprob_slice = property(lambda self: self._slice(5))

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


def apply_masks(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """Mask, in place and in one batched operation, logits [N, V] of `rows` to the tokens their
    grammar allows next (xgrammar's bitmask rows, one per entry of `rows`)."""
    import xgrammar as xgr

    words = -(-logits.shape[-1] // 32)
    full = np.full((logits.shape[0], words), -1, dtype=np.int32)  # every token allowed
    n = min(words, bitmask.shape[1])
    full[rows, :n] = bitmask[:, :n]
    xgr.apply_token_bitmask_inplace(logits, to_device(full, logits.device), indices=rows)


def _repetition(logits: torch.Tensor, pairs: torch.Tensor, settings: torch.Tensor) -> None:
    """vLLM's repetition penalty over the prompt and the output: positive logits divided, negative
    ones multiplied. A token listed twice for a row gets the same value twice (from the original)."""
    rows, toks = pairs.view(2, -1)
    vals = logits[rows, toks]
    penalty = settings[rows, _REP].to(logits.dtype)
    logits[rows, toks] = torch.where(vals > 0, vals / penalty, vals * penalty)


def _frequency_presence(logits: torch.Tensor, pairs: torch.Tensor, rows: torch.Tensor, settings: torch.Tensor) -> None:
    """vLLM's frequency and presence penalties over the output tokens, counted on the device, for
    `rows` (pairs index them 0.. in that order)."""
    local, toks = pairs.view(2, -1)
    counts = torch.zeros(rows.shape[0], logits.shape[1], dtype=logits.dtype, device=logits.device)
    counts.index_put_((local, toks), torch.ones_like(toks, dtype=logits.dtype), accumulate=True)
    sub = logits[rows]
    sub -= settings[rows, _FREQ, None].to(logits.dtype) * counts
    sub -= settings[rows, _PRES, None].to(logits.dtype) * (counts > 0).to(logits.dtype)
    logits[rows] = sub


def _apply_penalties(row: torch.Tensor, req) -> None:
    """One row's penalties in place (the batched path on a batch of one)."""
    plan = _Plan.build([req], row.shape[-1])
    settings, index = to_device(plan.settings, row.device), to_device(plan.index, row.device)
    logits = row.view(1, -1)
    if plan.rep_count:
        _repetition(logits, index[plan.rep_slice], settings)
    if plan.freq_rows:
        _frequency_presence(logits, index[plan.freq_slice], index[plan.counted_slice], settings)


def _banned(req, vocab: int) -> list[int]:
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


def filtered_probs(logits: torch.Tensor, settings: torch.Tensor, plan: "_Plan") -> torch.Tensor:
    """The distribution a random row draws from: softmax after temperature, top-k (ties with the
    k-th kept) and top-p (the smallest prefix reaching it, the first always); rows sum to 1 but
    for rounding. `settings` are the rows' own."""
    vocab = logits.shape[-1]
    x = logits.float() / settings[:, _TEMP, None].float()
    if plan.max_top_k < vocab:  # keep the k largest (ties with the k-th included)
        kth = x.topk(plan.max_top_k, dim=-1).values.gather(1, settings[:, _TOP_K, None].long() - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if plan.any_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # float64 thresholds: a top_p of 1e-300 is 0 in float32, which would drop every token
        before = sorted_probs.double().cumsum(-1) - sorted_probs.double()
        outside = before >= settings[:, _TOP_P, None]
        outside[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(outside, 0.0))
    return probs


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of (unnormalized) probs [R, V], by inverse transform of u [R] in [0, 1):
    the first token whose cumulative mass exceeds u x total, never one of zero probability."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].double() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The sampled tokens' logprobs and ranks and the top k of every logprob row, as float64 parts
    of the step's one read-back."""
    chosen = raw.gather(1, tokens[:, None])
    ranks = (raw > chosen).sum(-1) + 1
    parts = [chosen[:, 0].double(), ranks.double()]
    if k:
        top_vals, top_ids = raw.topk(k, dim=-1)
        parts += [top_ids.double().flatten(), top_vals.double().flatten()]
    return parts
