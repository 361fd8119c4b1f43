"""Turn logits into tokens: grammar masks, allowed tokens, logit biases, penalties, bad words,
min_tokens, greedy, temperature, min-p, top-k, top-p, and the logprobs a request asked for.
Stateless: every per-sequence state (random stream, tokens, settings) is the worker's `SeqState`
(input_batch.py); a step's grammar bitmask comes with its plan (backend/core/step.py).

The rows that sample are handled together, as tensors (temperature, min-p, top-k, top-p per row:
sampler_plan.py), and each draws its token by inverse transform from one uniform number of the
sequence's own seeded stream, so its tokens do not depend on its batch. Logprobs are vLLM v1's:
log_softmax of the raw logits, before penalties and temperature.

On a GPU a step's sampling costs the host two transfers (the per-row settings; every (row, token)
index of the penalties, bans, biases and allowed tokens), a third when a row has a logit_bias (its
values), and one read back (tokens and logprobs, packed): none per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from backend.core.step import Sampled
from backend.worker.device import to_device
from backend.worker.sampler_plan import FREQ, MIN_P, PRES, REP, TEMP, TOP_K, TOP_P, UNIFORM, SamplePlan, banned_tokens

# A step's grammar masks: (the logits rows they apply to, their bitmask rows [len(rows), words])
Masks = Optional[tuple[list[int], np.ndarray]]
__all__ = ["UNIFORM", "Masks", "sample", "prepare", "filtered_probs", "inverse_transform", "greedy_tokens"]


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
        tokens[rows] = inverse_transform(probs, prep.settings[rows, UNIFORM])
    return prep.read_back(tokens)[0]


def _argmax_of_raw_logits(req, vocab: int) -> bool:
    """Whether this row's token is its logits' argmax as they stand: greedy, no logprobs, no
    penalties, nothing banned now (what prepare() would change; a step's grammar mask aside)."""
    p = req.params
    if not p.greedy or p.logprobs is not None or p.penalized or p.biased:
        return False
    if not req.bad_words_ids and (len(req.output_token_ids) >= p.min_tokens
                                  or not (req.eos_token_ids or p.stop_token_ids)):
        return True  # (the common case, without building the list of bans)
    return not banned_tokens(req, vocab)


@dataclass
class Prepared:
    """A step's logits after everything but the draw: the plan, its settings and index on the
    device, and the raw logprobs of the rows that asked (before the grammar, penalties and bans,
    which are applied to the logits in place)."""
    plan: SamplePlan
    settings: torch.Tensor
    index: torch.Tensor
    raw: Optional[torch.Tensor]

    @property
    def random_rows(self) -> torch.Tensor:
        return self.index[self.plan.segment("random")]

    def read_back(self, tokens: torch.Tensor, extra: Sequence[torch.Tensor] = ()) -> tuple[list[Sampled], np.ndarray]:
        """The step's one read back: every row's token, the logprobs asked for, and `extra` (flat
        tensors, returned as one float64 array after the Sampled results)."""
        plan = self.plan
        parts = [tokens.double()]
        if self.raw is not None:
            parts += _logprobs(self.raw, tokens[self.index[plan.segment("logprob")]], plan.max_top)
        parts += [e.double().flatten() for e in extra]
        host = torch.cat(parts).cpu().numpy()
        tail = sum(e.numel() for e in extra)
        return plan.unpack(host[:len(host) - tail]), host[len(host) - tail:]


def prepare(logits: torch.Tensor, requests: Sequence, masks: Masks = None) -> Prepared:
    """Raw logprobs, then grammar masks, allowed tokens, logit biases, penalties and bans on logits
    [N, V] in place (vLLM's order), one row per sequence (or per position of a speculating row:
    backend/worker/rejection.py)."""
    n, vocab = logits.shape
    plan = SamplePlan.build(requests, vocab)
    dev = logits.device
    settings = to_device(plan.settings, dev)
    index = to_device(plan.index, dev)
    raw = torch.log_softmax(logits[plan.logprob_rows].float(), dim=-1) if plan.logprob_rows else None
    if masks is not None:  # structured outputs: after the raw logprobs, before everything else
        apply_masks(logits, *masks)
    if plan.has("allowed"):  # every other token of those rows to -inf
        rows, (pr, pt) = index[plan.segment("allowed_rows")], index[plan.segment("allowed")].view(2, -1)
        kept = logits[pr, pt]
        logits[rows] = float("-inf")
        logits[pr, pt] = kept
    if plan.has("bias"):
        pr, pt = index[plan.segment("bias")].view(2, -1)
        logits.index_put_((pr, pt), to_device(plan.bias_values, dev).to(logits.dtype), accumulate=True)
    _penalize(logits, plan, index, settings)
    if plan.ban_count:
        banned = index[plan.segment("ban")].view(2, -1)
        logits[banned[0], banned[1]] = float("-inf")
    return Prepared(plan, settings, index, raw)


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
    penalty = settings[rows, REP].to(logits.dtype)
    logits[rows, toks] = torch.where(vals > 0, vals / penalty, vals * penalty)


def _frequency_presence(logits: torch.Tensor, pairs: torch.Tensor, rows: torch.Tensor, settings: torch.Tensor) -> None:
    """vLLM's frequency and presence penalties over the output tokens, counted on the device, for
    `rows` (pairs index them 0.. in that order)."""
    local, toks = pairs.view(2, -1)
    counts = torch.zeros(rows.shape[0], logits.shape[1], dtype=logits.dtype, device=logits.device)
    counts.index_put_((local, toks), torch.ones_like(toks, dtype=logits.dtype), accumulate=True)
    sub = logits[rows]
    sub -= settings[rows, FREQ, None].to(logits.dtype) * counts
    sub -= settings[rows, PRES, None].to(logits.dtype) * (counts > 0).to(logits.dtype)
    logits[rows] = sub


def _penalize(logits: torch.Tensor, plan: SamplePlan, index: torch.Tensor, settings: torch.Tensor) -> None:
    if plan.rep_count:
        _repetition(logits, index[plan.segment("rep")], settings)
    if plan.freq_rows:
        _frequency_presence(logits, index[plan.segment("freq")], index[plan.segment("counted")], settings)


def _apply_penalties(row: torch.Tensor, req) -> None:
    """One row's penalties in place (the batched path on a batch of one)."""
    plan = SamplePlan.build([req], row.shape[-1])
    _penalize(row.view(1, -1), plan, to_device(plan.index, row.device), to_device(plan.settings, row.device))


def filtered_probs(logits: torch.Tensor, settings: torch.Tensor, plan: SamplePlan) -> torch.Tensor:
    """The distribution a random row draws from: softmax after temperature, min-p (tokens below
    min_p x the top token's probability dropped), top-k (ties with the k-th kept) and top-p (the
    smallest prefix reaching it, the first always); rows sum to 1 but for rounding. `settings` are
    the rows' own."""
    vocab = logits.shape[-1]
    x = logits.float() / settings[:, TEMP, None].float()
    if plan.any_min_p:  # p < min_p * p_max  <=>  x - x_max < log(min_p)  (min_p 0: -inf, none dropped)
        floor = x.amax(dim=-1, keepdim=True) + torch.log(settings[:, MIN_P, None].double()).float()
        x = torch.where(x < floor, float("-inf"), x)  # (amax and where: a third of max's and masked_fill's time)
    if plan.max_top_k < vocab:  # keep the k largest (ties with the k-th included)
        kth = x.topk(plan.max_top_k, dim=-1).values.gather(1, settings[:, TOP_K, None].long() - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if plan.any_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # float64 thresholds: a top_p of 1e-300 is 0 in float32, which would drop every token
        before = sorted_probs.double().cumsum(-1) - sorted_probs.double()
        outside = before >= settings[:, TOP_P, None]
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
