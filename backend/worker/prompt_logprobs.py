"""vLLM's prompt_logprobs: each prompt token's logprob (and rank, and the top k) under the model's
distribution at the position before it, from the prefill's own hidden states.

A prefill chunk of a sequence that asked for them keeps the logits of its prompt positions, not
only its last one's (`rows`: which positions of the flat batch, built with the step's inputs);
they are computed here in slices (a long chunk's [positions, vocabulary] logits would be large),
as the raw log_softmax (vLLM v1's, like the sampler's logprobs), read back once per step, and kept
by the sequence (`SeqState.prompt_logprobs`, by position, so a chunked prefill fills it chunk by
chunk and a recomputed one overwrites it) until the step that samples its first token hands the
whole list over with that token (`Sampled.prompt_logprobs`). Such a sequence never takes its
prompt from the prefix cache (backend/sched/admission.py), as in vLLM: every position is computed.
"""
from __future__ import annotations

from typing import Callable

import torch

SLICE = 256  # positions whose logits are made at once

# (the sequence, its first position's row in the flat batch, that position, how many positions)
PromptRows = list[tuple]


def chunk_rows(seq, flat_row: int, start: int, num_tokens: int) -> tuple | None:
    """The positions of a prefill chunk whose next token is a prompt token, for a sequence that
    asked for prompt logprobs (None: none). The prompt's last chunk is a row even where it has none
    (its last token alone): `hand_over` finds the sequence by its rows."""
    if seq.params.prompt_logprobs is None:
        return None
    count = min(start + num_tokens, len(seq.prompt_token_ids) - 1) - start
    last = start + num_tokens == len(seq.prompt_token_ids)
    return (seq, flat_row, start, max(count, 0)) if count > 0 or last else None


def compute(rows: PromptRows, hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Each row's prompt logprobs, into its sequence's list. `logits_of`: the LM head (on a
    tensor-parallel rank a collective, so every rank calls it for the same rows)."""
    parts, spans = [], []
    for seq, flat, start, count in rows:
        k = seq.params.prompt_logprobs
        targets = torch.tensor(seq.prompt_token_ids[start + 1:start + 1 + count], dtype=torch.int64,
                               device=hidden.device)
        for a in range(0, count, SLICE):
            b = min(a + SLICE, count)
            raw = torch.log_softmax(logits_of(hidden[flat + a:flat + b]).float(), dim=-1)
            chosen = raw.gather(1, targets[a:b, None])
            parts += [chosen[:, 0].double(), ((raw > chosen).sum(-1) + 1).double()]
            if k:
                top_vals, top_ids = raw.topk(k, dim=-1)
                parts += [top_ids.double().flatten(), top_vals.double().flatten()]
            spans.append((seq, start + a, b - a, k))
    if not parts:
        return
    host = torch.cat(parts).cpu().numpy()
    at = 0
    for seq, first, n, k in spans:
        chosen, ranks = host[at:at + n], host[at + n:at + 2 * n]
        ids, vals = host[at + 2 * n:at + 2 * n + n * k].reshape(n, k), host[at + 2 * n + n * k:at + 2 * n + 2 * n * k].reshape(n, k)
        at += 2 * n + 2 * n * k
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] * (len(seq.prompt_token_ids) - 1)
        for i in range(n):
            seq.prompt_logprobs[first + i] = (float(chosen[i]), int(ranks[i]),
                                              [(int(t), float(v)) for t, v in zip(ids[i], vals[i])])


def hand_over(rows: PromptRows, sampled: dict) -> None:
    """A sequence whose first token was sampled this step gets its prompt logprobs with it."""
    for seq, *_ in rows:
        s = sampled.get(seq.seq_id)
        if s is not None and not seq.output_token_ids:
            s.prompt_logprobs = list(seq.prompt_logprobs or [])
