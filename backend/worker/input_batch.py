"""The worker's persistent batch: every sequence the scheduler told it of, kept from step to step.

Each step's plan (backend/core/step.py) names new sequences once and then only what changed; this
applies it. A `SeqState` is a sequence as the worker knows it: its tokens (appended from the plans'
updates), its sampling settings and seeded random stream (core/request.py `sampling_stream`: a
sequence's tokens never depend on its batch), its adapter, its computed count and its row of the
block tables. The sampler and the rejection sampler read it as they read a request. A preempted
sequence keeps its state (tokens, random stream) and gives up its row; a finished one is dropped.

Block tables live in `BlockTables`, a device tensor with a row per held sequence; each sequence
keeps its own tables as lists too (the slots of its rows are computed from them on the host). A
plan's table deltas are written to both, the device's writes of a step going with its inputs in the
same two transfers (step_inputs.py). A model whose layers form several KV-cache groups
(backend/kv/groups.py) has a table per group for each sequence.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from backend.core.sampling_params import sampling_stream
from backend.core.step import NewSeq, StepPlan
from backend.core.tokens import TokenSequence
from backend.kv.block_pool import NULL_BLOCK

log = logging.getLogger(__name__)


class SeqState(TokenSequence):
    """A sequence as the worker holds it (what the sampler reads of a request)."""
    __slots__ = ("seq_id", "prompt_token_ids", "output_token_ids", "params", "eos_token_ids", "bad_words_ids",
                 "rng", "lora_name", "num_computed_tokens", "row", "tables", "_unique_prompt", "prompt_logprobs",
                 "pooling", "pool_sum")

    def __init__(self, new: NewSeq):
        self.seq_id = new.seq_id
        self.prompt_token_ids = list(new.prompt_token_ids)
        self.output_token_ids = list(new.output_token_ids)
        self.params = new.params
        self.eos_token_ids = tuple(new.eos_token_ids)
        self.bad_words_ids = new.bad_words_ids
        self.rng = sampling_stream(new.params, new.seed, new.index)
        self.lora_name = new.lora_name
        self.num_computed_tokens = new.num_computed_tokens
        self.row = -1  # its row of the block tables; -1: none (preempted)
        self.tables: list[list[int]] = [[] for _ in new.block_tables]  # per group, as the device holds them
        self._unique_prompt: Optional[np.ndarray] = None
        self.prompt_logprobs: Optional[list] = None  # by position, as its prefill computes them (prompt_logprobs.py)
        self.pooling = new.pooling  # a pooling sequence's type (pooler.py); None: it samples
        self.pool_sum = None  # mean pooling: the sum of its hidden states so far (cls: the first's)

    def set_tokens(self, tokens_from: int, new: list[int]) -> None:
        """Its tokens cut to `tokens_from` (-1: kept whole), then `new` appended."""
        if tokens_from >= 0:
            n = len(self.prompt_token_ids)
            if tokens_from < n:
                raise ValueError(f"{self.seq_id}: a plan may not cut into the prompt ({tokens_from} < {n})")
            del self.output_token_ids[tokens_from - n:]
        self.output_token_ids += new

    def unique_prompt(self) -> np.ndarray:
        """The prompt's distinct tokens (the repetition penalty's), worked out once."""
        if self._unique_prompt is None:
            self._unique_prompt = np.unique(np.asarray(self.prompt_token_ids, dtype=np.int64))
        return self._unique_prompt

    def __repr__(self) -> str:
        return f"SeqState({self.seq_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, row={self.row})"


class BlockTables:
    """Every held sequence's block tables, a row each, in one int32 device tensor [groups, rows,
    width]. Writes are queued for the device (`take_writes`: rows of the [groups * rows, width]
    view, columns, values). Entries past a sequence's length, and given-back ones (NULL_BLOCK,
    written as block 0), are stale but valid block ids: the kernels never read them, and the torch
    references only gather them for positions they mask."""

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device, groups: int = 1):
        self.width = width
        self.block_size = block_size
        self.device = device
        self.groups = groups
        rows = max(rows, 1)
        self.table = torch.zeros((groups, rows, width), dtype=torch.int32, device=device)
        self._free = list(range(rows - 1, -1, -1))
        self._ur: list[int] = []
        self._uc: list[int] = []
        self._uv: list[int] = []

    @property
    def rows(self) -> int:
        return self.table.shape[1]

    def reset(self) -> None:
        """Give every row back and zero the tables (after the warm-up)."""
        self._free = list(range(self.rows - 1, -1, -1))
        self.table.zero_()
        self.take_writes()

    def take_row(self) -> int:
        if not self._free:
            self._grow()
        return self._free.pop()

    def give_row(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, group: int, start: int, entries: list[int]) -> None:
        """The group's table of `row` from entry `start` on is `entries` (later entries stale)."""
        end = start + len(entries)
        if end > self.width:
            raise ValueError(f"a block table of {end} blocks exceeds the {self.width} that max_model_len allows")
        if not entries:
            return
        values = [b if b != NULL_BLOCK else 0 for b in entries]
        self._ur += [group * self.rows + row] * len(values)
        self._uc += range(start, end)
        self._uv += values

    def take_writes(self) -> tuple[list[int], list[int], list[int]]:
        writes = self._ur, self._uc, self._uv
        self._ur, self._uc, self._uv = [], [], []
        return writes

    def _grow(self) -> None:
        old = self.rows
        table = torch.zeros((self.groups, 2 * old, self.width), dtype=torch.int32, device=self.device)
        table[:, :old] = self.table
        # queued writes name rows of the old [groups * rows, width] view: renumber them
        self._ur = [(r // old) * 2 * old + r % old for r in self._ur]
        self.table = table
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free
        log.info("block tables grown to %d rows", 2 * old)


class InputBatch:
    """The sequences the worker holds, by id, and their block tables."""

    def __init__(self, tables: BlockTables):
        self.tables = tables
        self.seqs: dict[str, SeqState] = {}

    def apply(self, plan: StepPlan) -> None:
        """Take in a plan's deltas: forget the finished, give the preempted's rows back, add the new,
        update the held (tokens, computed counts, table entries)."""
        for seq_id in plan.finished_ids:
            state = self.seqs.pop(seq_id, None)
            if state is not None and state.row >= 0:
                self.tables.give_row(state.row)
        for seq_id in plan.preempted_ids:
            state = self.seqs.get(seq_id)
            if state is not None and state.row >= 0:
                self.tables.give_row(state.row)
                state.row = -1
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise ValueError(f"{new.seq_id} is already held: a plan names a sequence new once")
            state = self.seqs[new.seq_id] = SeqState(new)
            state.row = self.tables.take_row()
            for group, table in enumerate(new.block_tables):
                self._write(state, group, 0, table)
        for update in plan.updates:
            state = self.seqs[update.seq_id]
            state.set_tokens(update.tokens_from, update.new_token_ids)
            state.num_computed_tokens = update.num_computed_tokens
            if update.resumed and state.row < 0:
                state.row = self.tables.take_row()
            for group, (start, entries) in enumerate(update.blocks):
                self._write(state, group, start, entries)

    def _write(self, state: SeqState, group: int, start: int, entries: list[int]) -> None:
        """A sequence's table of `group` from entry `start` on is `entries`, on the device and in
        its own list (stale entries past its end kept, as on the device)."""
        self.tables.write(state.row, group, start, entries)
        table = state.tables[group]
        if start > len(table):
            table.extend([0] * (start - len(table)))
        table[start:start + len(entries)] = entries

    def __getitem__(self, seq_id: str) -> SeqState:
        return self.seqs[seq_id]

    def __len__(self) -> int:
        return len(self.seqs)

    def reset(self) -> None:
        self.seqs.clear()
        self.tables.reset()
