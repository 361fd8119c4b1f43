"""A step's rows grouped by adapter, once per step. No torch here.

The worker orders each part of the flat batch (decode rows, then prefill chunks) by adapter before
it builds the step's inputs, so every adapter's rows are contiguous (at most two runs each: its
decode rows and its prefill chunks), and every layer's LoRA products work on row ranges: slices,
never gathers. The order within one adapter is the scheduler's (a stable sort), and the base
model's rows (no adapter) come first.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

AdapterOf = Callable[[object], Optional[str]]  # a row's adapter name (None: the base model)


def order_by_adapter(rows: list, adapter_of: AdapterOf) -> list:
    """`rows` grouped by adapter, base rows first; the list itself when no row has an adapter (the
    common case costs one pass)."""
    names = [adapter_of(r) for r in rows]
    if not any(names):
        return rows
    order = sorted(range(len(rows)), key=lambda i: names[i] or "")
    return [rows[i] for i in order]


def adapter_runs(first_row: int, rows: Sequence, adapter_of: AdapterOf) -> list[tuple[int, int, str]]:
    """(first row, end row, adapter) of each run of rows of one adapter, in the flat batch that
    starts with `rows` at `first_row`; rows of the base model are in no run."""
    runs: list[tuple[int, int, str]] = []
    row = first_row
    for r in rows:
        name = adapter_of(r)
        end = row + r.num_new_tokens
        if name:
            if runs and runs[-1][1] == row and runs[-1][2] == name:
                runs[-1] = (runs[-1][0], end, name)
            else:
                runs.append((row, end, name))
        row = end
    return runs
