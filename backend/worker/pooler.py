"""Pooling on the worker (docs/pooling.md): a pooling sequence's prompt runs in the step's flat
batch like any prompt, chunked like any prompt, and is pooled instead of sampled.

Each chunk's rows of the model's output (the hidden states after the final norm) are taken here:
mean pooling adds them to the sequence's running sum (exact across chunks: the mean of the whole
prompt is the sum of every chunk's over the prompt's length), first-token (cls) pooling keeps
position 0's, last-token pooling waits for the last chunk. With the last chunk the sequence's
pooled vector is made, put through the model's score head when it has one (a cross-encoder), and
answered as `Sampled(token=-1, pooled=...)` (backend/core/step.py); the engine side finishes it
(backend/core/pooling.py: Matryoshka cut, normalization, sigmoid). Every prompt token of a mean or
cls sequence is computed (its prefix is never taken from the cache: Request.computes_whole_prompt),
and a sequence started again from position 0 (after a preemption) starts its sum again.
"""
from __future__ import annotations

import torch

from backend.core.step import Sampled
from backend.worker import prompt_logprobs


def read_hidden(step, hidden: torch.Tensor, model) -> None:
    """What a step (step_inputs.StepInputs) takes from its hidden states besides the sampled rows'
    logits: its prompt-logprob positions (prompt_logprobs.py; a prompt's one-token chunk may run as
    a decode row) and its pooling rows (`step.pooled`)."""
    if step.prompt_rows:
        prompt_logprobs.compute(step.prompt_rows, hidden, model.logits)
    if step.pool_rows:
        step.pooled = pool_step(step.pool_rows, hidden, getattr(model, "score", None))


def pool_step(pool_rows: list, hidden: torch.Tensor, score=None) -> dict[str, Sampled]:
    """The step's pooling rows (step_inputs.StepInputs.pool_rows: (SeqState, first row of
    `hidden`, rows, start position, last chunk)) taken from `hidden` [T, hidden]; the sequences
    whose last chunk ran, by seq_id. `score`: the model's score head (a Linear), or None."""
    done: dict[str, Sampled] = {}
    for seq, first, rows, start, last in pool_rows:
        h = hidden[first:first + rows]
        if start == 0:
            seq.pool_sum = None
        if seq.pooling == "mean":
            part = h.float().sum(dim=0)
            seq.pool_sum = part if seq.pool_sum is None else seq.pool_sum + part
        elif seq.pooling == "cls" and start == 0:
            seq.pool_sum = h[0].float()
        if not last:
            continue
        if seq.pooling == "last":
            pooled = h[-1]
        elif seq.pooling == "mean":
            pooled = seq.pool_sum / float(start + rows)
        else:
            pooled = seq.pool_sum
        if score is not None:
            pooled = score(pooled.to(hidden.dtype).unsqueeze(0))[0]  # (the head may be a packed linear)
        done[seq.seq_id] = Sampled(token=-1, pooled=pooled.float().cpu().tolist())
        seq.pool_sum = None
    return done
