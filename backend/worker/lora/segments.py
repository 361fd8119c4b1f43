"""A step's rows grouped by adapter, once per step. No torch here.

The runner orders each part of the flat batch (decode rows, then prefill chunks) by adapter before
it builds the step's inputs, so every adapter's rows are contiguous (at most two runs each: its
decode rows and its prefill chunks), and every layer's LoRA products work on row ranges: slices,
never gathers. The order within one adapter is the scheduler's (a stable sort), and the base
model's rows (no adapter) come first.
"""
from __future__ import annotations

from typing import Optional, Sequence


def _key(seq) -> str:
    return seq.request.lora_name or ""


def order_by_adapter(seqs: list) -> list:
    """`seqs` (ScheduledSeqs) grouped by adapter, base rows first; the list itself when no row
    has an adapter (the common case costs one pass)."""
    if not any(s.request.lora_name for s in seqs):
        return seqs
    return sorted(seqs, key=_key)


def adapter_runs(first_row: int, seqs: Sequence) -> list[tuple[int, int, str]]:
    """(first row, end row, adapter) of each run of rows of one adapter, in the flat batch that
    starts with `seqs`' rows at `first_row`; rows of the base model are in no run."""
    runs: list[tuple[int, int, str]] = []
    row = first_row
    for s in seqs:
        name: Optional[str] = s.request.lora_name
        end = row + s.num_new_tokens
        if name:
            if runs and runs[-1][1] == row and runs[-1][2] == name:
                runs[-1] = (runs[-1][0], end, name)
            else:
                runs.append((row, end, name))
        row = end
    return runs
