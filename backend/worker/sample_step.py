"""A step's sampling, once its logits are computed: which logits rows belong to which sequence, the
plan's grammar masks placed on those rows, then the sampler (sampler.py) or, when a row verifies
drafts, the rejection sampler (rejection.py). One read back for the step either way."""
from __future__ import annotations

from typing import Optional

import torch

from backend.core.step import GrammarMasks, Sampled
from backend.worker.rejection import verify
from backend.worker.sampler import Masks, sample
from backend.worker.step_inputs import StepInputs


def _masks(grammar: Optional[GrammarMasks], step: StepInputs) -> Masks:
    """The grammar masks by logits row: a sequence's row is its last position (constrained rows
    never carry drafts, so they have one)."""
    if grammar is None:
        return None
    first, pos = {}, 0
    for seq, row in zip(step.sampling, step.sampled_rows):
        first[seq.seq_id] = pos
        pos += 1 + len(row.draft_token_ids)
    rows = [first[sid] for sid in grammar.seq_ids if sid in first]
    if len(rows) != len(grammar.seq_ids):
        missing = sorted(set(grammar.seq_ids) - set(first))
        raise ValueError(f"grammar masks for sequences that sample nothing this step: {missing}")
    return rows, grammar.bitmask


def sample_step(logits: torch.Tensor, step: StepInputs, grammar: Optional[GrammarMasks]) -> dict[str, Sampled]:
    """What every sampling sequence produced this step, by seq_id (a verify row's drafts checked)."""
    masks = _masks(grammar, step)
    if step.has_drafts:
        return verify(logits, step.sampled_rows, step.sampling, masks)
    return {seq.seq_id: s for seq, s in zip(step.sampling, sample(logits, step.sampling, masks))}
