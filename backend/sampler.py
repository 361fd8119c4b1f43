"""Turn logits into tokens: penalties, bad words, min_tokens, greedy, temperature, top-k, top-p,
and the logprobs a request asked for. Stateless: every per-request state (its random stream, its
tokens) lives on the `Request`.

The rows that sample are handled together, as tensors (temperature, top-k, top-p per row), and each
draws its token by inverse transform from one uniform number taken from the request's own seeded
`random.Random`, advanced once per generated token, so a request's tokens do not depend on which
other requests share the batch. Logprobs are vLLM v1's: log_softmax of the raw logits, before
penalties and temperature.
"""
from __future__ import annotations

from typing import Sequence

import torch

from backend.outputs import Sampled
from backend.request import Request
from backend.structured.matcher import apply_grammar_masks


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[Sampled]:
    """logits [N, V] float32, one row per request (modified in place); returns N results."""
    want_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    raw = torch.log_softmax(logits[want_logprobs].float(), dim=-1) if want_logprobs else None
    apply_grammar_masks(logits, requests)  # structured outputs: after the raw logprobs, before everything else
    for i, req in enumerate(requests):
        if req.params.penalized:
            _apply_penalties(logits[i], req)
        _ban(logits[i], _banned(req, logits.shape[-1]))
    tokens = logits.argmax(dim=-1)
    rows = [i for i, req in enumerate(requests) if not req.params.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        tokens[idx] = _draw(logits[idx], [requests[i] for i in rows])
    out = [Sampled(t) for t in tokens.tolist()]
    if raw is not None:
        _fill_logprobs(out, raw, want_logprobs, requests)
    return out


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    """vLLM's formulas: repetition over the prompt and the output (positive logits divided, negative
    ones multiplied); presence and frequency over the output only."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)), device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if req.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(req.output_token_ids, device=row.device), minlength=row.shape[0])
        row -= p.frequency_penalty * counts[:row.shape[0]].to(row.dtype)
        row -= p.presence_penalty * (counts[:row.shape[0]] > 0).to(row.dtype)


def _banned(req: Request, vocab: int) -> list[int]:
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


def _ban(row: torch.Tensor, tokens: list[int]) -> None:
    if tokens:
        row[tokens] = float("-inf")


def _draw(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    n, vocab = logits.shape
    dev = logits.device
    params = [r.params for r in requests]
    x = logits.float() / torch.tensor([[p.temperature] for p in params], device=dev)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:  # keep the k largest (ties with the k-th included)
        kth = x.topk(max(top_k), dim=-1).values.gather(1, torch.tensor([[k - 1] for k in top_k], device=dev))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:  # keep the smallest prefix whose mass reaches top_p (the first always)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # float64 thresholds: a top_p of 1e-300 is 0 in float32, which would drop every token
        before = sorted_probs.double().cumsum(-1) - sorted_probs.double()
        outside = before >= torch.tensor([[p] for p in top_p], dtype=torch.float64, device=dev)
        outside[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(outside, 0.0))
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.tensor([[r.rng.random()] for r in requests], dtype=torch.float64, device=dev)
    # The first token whose cumulative mass exceeds u x total: never one of zero probability.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)


def _fill_logprobs(out: list[Sampled], raw: torch.Tensor, rows: list[int], requests: Sequence[Request]) -> None:
    tokens = torch.tensor([out[i].token for i in rows], device=raw.device)
    chosen = raw.gather(1, tokens[:, None])
    ranks = (raw > chosen).sum(-1) + 1
    k = max(requests[i].params.logprobs for i in rows)
    top_vals, top_ids = raw.topk(k, dim=-1) if k else (None, None)
    for j, i in enumerate(rows):
        out[i].logprob = float(chosen[j])
        out[i].rank = int(ranks[j])
        want = requests[i].params.logprobs
        out[i].top = list(zip(top_ids[j, :want].tolist(), top_vals[j, :want].tolist())) if want else []
