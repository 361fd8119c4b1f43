"""Turn logits into tokens: greedy, temperature, top-k, top-p, min_tokens; seeded per request.

Each request that samples owns a torch.Generator seeded from its `seed`, and draws exactly one
number per generated token, so its tokens do not depend on which other requests share the batch.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

from backend.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)  # seeds for requests that gave none
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            seed = req.params.seed if req.params.seed is not None else self._rng.getrandbits(63)
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            self._generators[req.request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """logits [N, V] float32, one row per request; returns N token ids."""
        self._mask_min_tokens(logits, requests)
        tokens = logits.argmax(dim=-1).tolist()
        for i, req in enumerate(requests):
            if not req.params.greedy:
                tokens[i] = self._draw(logits[i].cpu(), req)
        return tokens

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Until a request has min_tokens outputs, it may not stop on EOS or a stop token."""
        vocab = logits.shape[-1]
        for i, req in enumerate(requests):
            if len(req.output_token_ids) < req.params.min_tokens:
                banned = [t for t in (*req.eos_token_ids, *req.params.stop_token_ids) if 0 <= t < vocab]
                if banned:
                    logits[i, banned] = float("-inf")

    def _draw(self, row: torch.Tensor, req: Request) -> int:
        p = req.params
        row = row / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            outside = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(req)))
