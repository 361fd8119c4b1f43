"""Verifying drafts in the target's own step, so that what comes out is what the target would have
sampled alone (Leviathan et al. 2023; Chen et al. 2023).

A verify row holds a sequence's last token t and its k drafts d1..dk; the target's logits at its
k + 1 positions give p_0 .. p_k, p_j being the distribution of the token after t, d1..dj. Each
position is sampled as if the tokens before it had been generated one by one: penalties, bad
words and min_tokens bans see the output followed by the drafts before the position
(`DraftPosition`), then temperature, top-k and top-p make p_j (sampler.filtered_probs). Then, from
j = 0 on:
- temperature 0: d_{j+1} is accepted when it is p_j's argmax; the first that is not is replaced by
  the argmax. Greedy outputs are exactly those without speculation.
- temperature > 0: d_{j+1} ~ q_j is accepted with probability min(1, p_j(d)/q_j(d)); on rejection
  the token is drawn from norm(max(0, p_j - q_j)) instead, and the row ends there. With n-gram or
  greedy drafts q_j is a point mass on d: acceptance with probability p_j(d), the replacement from
  p_j without d. Either way each emitted token has exactly the target's distribution.
When all k are accepted a last token is drawn from p_k (the bonus), so a row emits 1..k+1 tokens.

Randomness: each position takes one uniform number from the request's own stream (the sampler
draws it), as a token generated alone does. The acceptance test uses u; a rejected position draws
its replacement with (u - a) / (1 - a), which given u >= a is again uniform on [0, 1) and
independent of the decision, so no second number is needed.

Logprobs are those of the emitted tokens at their positions (raw log_softmax, as the sampler's).
The whole step, plain rows included (a plain row is a verify row with no drafts), is read back once.
"""
from __future__ import annotations

from typing import Sequence

import torch

from backend.core.step import Row, Sampled
from backend.worker.sampler import UNIFORM, Masks, filtered_probs, greedy_tokens, inverse_transform, prepare


class DraftPosition:
    """A sequence as it stands at position j of its verify row: its output followed by the first j
    drafts. The sampler reads it as it reads the sequence (the prompt, the stop and ban settings
    and the random stream are the sequence's own); constrained rows never speculate."""
    __slots__ = ("seq", "params", "prompt_token_ids", "output_token_ids", "eos_token_ids", "bad_words_ids", "rng")

    def __init__(self, seq, drafts: list[int], params=None):
        self.seq = seq
        self.params = params or seq.params
        self.prompt_token_ids = seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + drafts
        self.eos_token_ids = seq.eos_token_ids
        self.bad_words_ids = seq.bad_words_ids
        self.rng = seq.rng

    def unique_prompt(self):
        return self.seq.unique_prompt()


def verify(logits: torch.Tensor, rows: Sequence[Row], seqs: Sequence, masks: Masks = None) -> dict[str, Sampled]:
    """logits [P, V] (modified in place): each sampling row's positions in order, 1 + its drafts
    for a verify row; `seqs`: the rows' sequences (input_batch.SeqState); `masks`: grammar masks
    by position. Returns each row's result by seq_id: its last token, after the drafts it
    accepted (`Sampled.accepted`)."""
    views: list = []
    checks: list[int] = []  # per position: the draft it checks, -1 at a row's last position
    for r, seq in zip(rows, seqs):
        drafts = r.draft_token_ids
        views.append(seq)
        views += [DraftPosition(seq, drafts[:j]) for j in range(1, len(drafts) + 1)]
        checks += drafts + [-1]
    prep = prepare(logits, views, masks)
    dev = logits.device
    drafted = torch.tensor(checks, dtype=torch.int64, device=dev)
    tokens = greedy_tokens(logits)
    accept = tokens == drafted  # temperature 0: the draft is the argmax
    if prep.plan.random_rows:
        random = prep.random_rows
        settings = prep.settings[random]
        probs = filtered_probs(logits[random], settings, prep.plan)
        q = _draft_distributions(rows, prep.plan.random_rows, drafted[random], probs.shape[-1], dev)
        tokens[random], accept[random] = _rejection_sample(probs, drafted[random], q, settings[:, UNIFORM])
    results, tail = prep.read_back(tokens, [accept])
    out: dict[str, Sampled] = {}
    pos = 0
    for r in rows:
        k = len(r.draft_token_ids)
        m = 0
        while m < k and tail[pos + m] > 0.5:
            m += 1
        last = results[pos + m]
        last.accepted, last.num_drafts = results[pos:pos + m], k
        out[r.seq_id] = last
        pos += k + 1
    return out


def _rejection_sample(probs: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor,
                      u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Random positions: probs [R, V] the target's filtered distribution (unnormalized after
    top-p), drafted [R] the draft each checks (-1: none), q [R, V] the draft distribution of
    positions with a draft, u [R] their uniform numbers. Returns (token, accepted) per position."""
    has = drafted >= 0
    d = drafted.clamp(min=0)[:, None]
    p = probs.double() / probs.double().sum(-1, keepdim=True)
    q = q.double()
    ratio = (p.gather(1, d) / q.gather(1, d)).clamp(max=1.0)[:, 0]  # min(1, p(d)/q(d))
    ratio = torch.where(has, torch.nan_to_num(ratio, nan=0.0), torch.zeros_like(ratio))
    accepted = has & (u < ratio)
    residual = torch.where(has[:, None], (p - q).clamp(min=0.0), probs.double())
    rescaled = ((u - ratio) / (1.0 - ratio).clamp(min=1e-300)).clamp(0.0, 1.0)
    token = inverse_transform(residual, torch.where(has, rescaled, u))
    return torch.where(accepted, drafted, token), accepted


def _draft_distributions(rows: Sequence[Row], random_positions: list[int], drafted: torch.Tensor,
                         vocab: int, dev: torch.device) -> torch.Tensor:
    """q [R, V] for the random positions: the draft model's distribution where a row carries one
    (probabilistic drafts), else a point mass on the draft (n-gram, greedy drafts)."""
    q = torch.zeros((len(random_positions), vocab), dtype=torch.float64, device=dev)
    has = drafted >= 0
    q[has, drafted[has]] = 1.0
    local = {p: i for i, p in enumerate(random_positions)}
    pos = 0
    for r in rows:
        k = len(r.draft_token_ids)
        if r.draft_probs is not None and k and pos in local:
            q[local[pos]:local[pos] + k] = r.draft_probs[:k].double()
        pos += k + 1
    return q
