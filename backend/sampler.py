"""Turn logits into tokens: greedy, temperature, top-k, top-p, min_tokens; seeded per request.

The rows that sample are handled together, as tensors (temperature, top-k, top-p per row), and each
draws its token by inverse transform from one uniform number. That number comes from the request's
own `random.Random`, seeded from its `seed` and advanced once per generated token, so a request's
tokens do not depend on which other requests share the batch.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

from backend.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)  # seeds for requests that gave none
        self._streams: dict[str, random.Random] = {}

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _uniform(self, req: Request) -> float:
        stream = self._streams.get(req.request_id)
        if stream is None:
            seed = req.params.seed if req.params.seed is not None else self._rng.getrandbits(63)
            stream = self._streams[req.request_id] = random.Random(seed)
        return stream.random()

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """logits [N, V] float32, one row per request; returns N token ids."""
        self._mask_min_tokens(logits, requests)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, req in enumerate(requests) if not req.params.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            tokens[idx] = self._draw(logits[idx], [requests[i] for i in rows])
        return tokens.tolist()

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Until a request has min_tokens outputs, it may not stop on EOS or a stop token."""
        vocab = logits.shape[-1]
        for i, req in enumerate(requests):
            if len(req.output_token_ids) < req.params.min_tokens:
                banned = [t for t in (*req.eos_token_ids, *req.params.stop_token_ids) if 0 <= t < vocab]
                if banned:
                    logits[i, banned] = float("-inf")

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
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
            outside = sorted_probs.cumsum(-1) - sorted_probs >= torch.tensor([[p] for p in top_p], device=dev)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(outside, 0.0))
        cdf = probs.double().cumsum(-1)
        total = cdf[:, -1:]
        u = torch.tensor([[self._uniform(r)] for r in requests], dtype=torch.float64, device=dev)
        # The first token whose cumulative mass exceeds u x total: never one of zero probability.
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
