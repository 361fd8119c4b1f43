"""One step's flat inputs, built on the host and sent to the device in two transfers.

The flat batch is [empty rows][decode rows][prefill chunks]. Empty rows pad the step to a size the
device path wants (a GEMM bucket on the CPU fast path, a captured CUDA graph's batch size): decode
rows of empty sequences, stored nowhere (slot -1), attending to nothing (length 0: the kernels
give zeros), never sampled. Padding rows of padded batches (static, dynamic) go through the model
like the others, one-token rows with the decodes and longer ones with the prefills; they read
their member's cache but are never stored nor sampled.

Block tables live in `BlockTables`, a device tensor with a row per scheduled sequence that is kept
from step to step: a step writes only what changed (a new sequence's table, the blocks a sequence
gained), instead of rebuilding every table from Python lists (2.7 ms at 256 sequences of 8k
tokens). Each step gathers its rows from it on the device. A model whose layers form several
KV-cache groups (backend/kv/groups.py: local sliding-window layers beside global ones) has a table
per group for each sequence and a slot mapping per group: both carry the group first.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from backend.kv.block_pool import NULL_BLOCK
from backend.worker.device import to_device
from backend.worker.lora.segments import adapter_runs, order_by_adapter

log = logging.getLogger(__name__)
PAD_TOKEN_ID = 0  # what padding and empty rows feed the model; their results are discarded


class BlockTables:
    """Every scheduled sequence's block tables, a row each, in one int32 device tensor
    [groups, rows, width]: a table per KV-cache group.

    A sequence keeps its row while it is scheduled; a row whose sequence was not in the last step
    is given to a new one. A row remembers, per group, the table it was written from (the block
    manager's list, which only grows by appending or gives back entries before the window,
    NULL_BLOCK; any other change gives the sequence a new list) and how many entries it wrote, so
    the next step writes only the new ones. Entries past a sequence's length, and given-back ones
    (written as block 0), are stale but valid block ids: the kernels never read them, and the
    torch references only gather them for positions they mask."""

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device, groups: int = 1):
        self.width = width
        self.block_size = block_size
        self.device = device
        self.groups = groups
        self.table = torch.zeros((groups, max(rows, 1), width), dtype=torch.int32, device=device)
        self._row_of: dict[str, int] = {}
        # per row: None, or per group (the list it was written from, entries written, the last one)
        self._held: list[Optional[list]] = [None] * self.table.shape[1]

    @property
    def rows(self) -> int:
        return self.table.shape[1]

    def reset(self) -> None:
        """Forget every sequence (after the warm-up) and zero the table."""
        self._row_of.clear()
        self._held = [None] * self.rows
        self.table.zero_()

    def assign(self, seqs: list) -> tuple[list[int], list[int], list[int], list[int]]:
        """The rows of `seqs` (ScheduledSeqs, in order) and the writes the step must make:
        (rows, update rows of the [groups * rows, width] view, update columns, update values)."""
        rows = [-1] * len(seqs)
        claimed = set()
        for i, s in enumerate(seqs):
            row = self._row_of.get(s.request.seq_id)
            if row is not None:
                rows[i] = row
                claimed.add(row)
        if -1 in rows:
            self._give_rows(seqs, rows, claimed)
        ur: list[int] = []
        uc: list[int] = []
        uv: list[int] = []
        height = self.rows
        for row, s in zip(rows, seqs):
            tables = (s.block_table, *s.group_tables)
            if len(tables) != self.groups:
                raise ValueError(f"{s.request.seq_id} has {len(tables)} block tables for {self.groups} KV-cache groups")
            held = self._held[row] or [None] * self.groups
            for g, table in enumerate(tables):
                n = len(table)
                if n > self.width:
                    raise ValueError(f"a block table of {n} blocks exceeds the {self.width} that max_model_len allows")
                start = 0
                if held[g] is not None and held[g][0] is table and held[g][1] <= n and (
                        held[g][1] == 0 or table[held[g][1] - 1] == held[g][2]):
                    start = held[g][1]
                if n > start:
                    ur += [g * height + row] * (n - start)
                    uc += range(start, n)
                    uv += [b if b != NULL_BLOCK else 0 for b in table[start:n]]
                held[g] = (table, n, table[n - 1] if n else None)
            self._held[row] = held
        return rows, ur, uc, uv

    def _give_rows(self, seqs: list, rows: list[int], claimed: set) -> None:
        for seq_id in [sid for sid, row in self._row_of.items() if row not in claimed]:
            self._held[self._row_of.pop(seq_id)] = None   # its sequence left the batch
        free = [r for r, held in enumerate(self._held) if held is None and r not in claimed]
        free.reverse()
        for i, s in enumerate(seqs):
            if rows[i] != -1:
                continue
            seq_id = s.request.seq_id
            if seq_id in self._row_of:               # listed twice in one step: one row
                rows[i] = self._row_of[seq_id]
                continue
            if not free:
                free = self._grow()
            rows[i] = self._row_of[seq_id] = free.pop()
            self._held[rows[i]] = None

    def grow_to(self, rows: int) -> None:
        """At least `rows` rows (a tensor-parallel rank follows the growth of rank 0's table)."""
        while self.rows < rows:
            self._grow()

    def _grow(self) -> list[int]:
        old = self.rows
        table = torch.zeros((self.groups, 2 * old, self.width), dtype=torch.int32, device=self.device)
        table[:, :old] = self.table
        self.table = table
        self._held += [None] * old
        log.info("block tables grown to %d rows", 2 * old)
        return list(range(2 * old - 1, old - 1, -1))


@dataclass
class StepInputs:
    """One step's device tensors and the host facts the launches need."""
    ids: torch.Tensor                 # [T] int64
    positions: torch.Tensor           # [T] int64
    slot_mapping: torch.Tensor        # [groups, T] int64, -1: not stored
    decode_rows: torch.Tensor         # [D] int64: each decode row's row of BlockTables
    decode_seq_lens: torch.Tensor     # [D] int32
    prefill_rows: torch.Tensor        # [P] int64
    prefill_cu_seqlens_q: torch.Tensor  # [P + 1] int32
    prefill_seq_lens: torch.Tensor    # [P] int32
    sample_index: torch.Tensor        # [S] int64: rows of the model's output whose logits are sampled
    num_decode_rows: int
    decode_width: int                 # blocks the decode rows need (host-side bound)
    prefill_width: int
    decode_max_seq_len: int
    prefill_max_q_len: int
    pure_decode: bool                 # no prefill rows: a decode step (graphable)
    # Rank 0's alone (tensor parallelism's other ranks compute the step, rank 0 samples it):
    sampling: list = field(default_factory=list)      # the Requests that sample, in sample_index order
    sampled_seqs: list = field(default_factory=list)  # their ScheduledSeqs (a verify row has 1 + drafts rows in sample_index)
    has_drafts: bool = False          # some row verifies drafts (backend/worker/rejection.py samples the step)
    # LoRA (every rank): the adapter runs (first row, end row, slot) and the slot writes (slot, load
    # id) rank 0 made for them (backend/worker/lora/manager.py)
    lora_runs: list = field(default_factory=list)
    lora_writes: list = field(default_factory=list)


@dataclass
class HostStep:
    """A step's integers packed on the host (one int64 and one int32 array, parts 16-byte aligned)
    with the facts the launches need: what build_step places on the device, and what tensor
    parallelism's rank 0 sends every other rank (backend/worker/parallel/step_message.py)."""
    int64: np.ndarray
    int64_sizes: list[int]   # ids, positions, slots (per group), decode rows, prefill rows, sample index, table writes (row, col),
    #                          LoRA runs (first row, end row, slot)..., LoRA slot writes (slot, load id)...
    int32: np.ndarray
    int32_sizes: list[int]   # decode lengths, prefill cu_seqlens, prefill lengths, table writes (value)
    num_decode_rows: int
    decode_width: int
    prefill_width: int
    decode_max_seq_len: int
    prefill_max_q_len: int
    pure_decode: bool
    table_rows: int          # the BlockTables rows its row numbers assume


def build_step(out, tables: BlockTables, empty_rows: int, verify_as_decode: bool = False, send=None,
               lora=None) -> StepInputs:
    """SchedulerOutput -> StepInputs: the host work of a step, then two host-to-device copies (the
    int64 and the int32 arrays) and the block-table writes. Each part is grouped by LoRA adapter,
    so an adapter's rows are row ranges in every layer. `verify_as_decode`: a verify row's
    1 + k queries attend as 1 + k decode rows of one sequence (lengths start + 1 .. start + 1 + k:
    causal, its K/V stored first like every row's) rather than as a prefill chunk; the CPU's
    decode kernel reads the cache where it lies, where prefill attention copies the context.
    `send(host_step)`, when given, gets the packed step before it is placed (tensor parallelism:
    rank 0 sends it to the other ranks). `lora`: the LoRAManager that gives the adapter runs their
    slots (its `assign`), when LoRA is on."""
    verify = [s for s in out.prefills if s.draft_token_ids] if verify_as_decode else []
    decodes = order_by_adapter(out.decodes + [s for s in out.padding if s.num_new_tokens == 1] + verify)
    prefills = order_by_adapter([s for s in out.prefills if not (verify and s.draft_token_ids)]
                                + [s for s in out.padding if s.num_new_tokens > 1])
    seqs = decodes + prefills
    rows, ur, uc, uv = tables.assign(seqs)
    ids: list[int] = [PAD_TOKEN_ID] * empty_rows
    positions: list[int] = [0] * empty_rows
    slots: list[list[int]] = [[-1] * empty_rows for _ in range(tables.groups)]  # per KV-cache group
    bs = tables.block_size
    sample_index: list[int] = []
    sampling = []
    sampled_seqs = []
    end = empty_rows
    for s in seqs:  # plain ints: most rows are one decode token, where numpy costs more
        start, n = s.start, s.num_new_tokens
        positions += range(start, start + n)
        end += n
        if s.padding:
            ids += [PAD_TOKEN_ID] * n
            for group_slots in slots:
                group_slots += [-1] * n
            continue
        drafts = s.draft_token_ids  # a verify row: its last token, then its drafts
        ids += s.request.token_ids(start, start + n - len(drafts))
        ids += drafts
        for group_slots, table in zip(slots, (s.block_table, *s.group_tables)):
            group_slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        if s.samples:
            sample_index += range(end - 1 - len(drafts), end)  # a verify row keeps every position's logits
            sampling.append(s.request)
            sampled_seqs.append(s)
    nd = len(decodes)
    d_lens = [0] * empty_rows + [s.start + 1 + i for s in decodes for i in range(s.num_new_tokens)]
    d_rows = [0] * empty_rows + [row for row, s in zip(rows, decodes) for _ in range(s.num_new_tokens)]
    q_lens = [s.num_new_tokens for s in prefills]
    p_lens = [s.start + s.num_new_tokens for s in prefills]
    cu = np.zeros(len(prefills) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    blocks = lambda n_tokens: min(-(-n_tokens // bs), tables.width)  # noqa: E731
    lora_runs, lora_writes = lora.assign(adapter_runs(empty_rows, seqs)) if lora is not None else ([], [])
    int64, int64_sizes = _pack([ids, positions, [x for group_slots in slots for x in group_slots], d_rows, rows[nd:],
                                sample_index, ur, uc,
                                [v for run in lora_runs for v in run], [v for w in lora_writes for v in w]], np.int64)
    int32, int32_sizes = _pack([d_lens, cu, p_lens, uv], np.int32)
    host = HostStep(int64, int64_sizes, int32, int32_sizes, num_decode_rows=len(d_lens),
                    decode_width=max([1] + [blocks(n) for n in d_lens]),
                    prefill_width=max([1] + [blocks(n) for n in p_lens]),
                    decode_max_seq_len=max(d_lens, default=0), prefill_max_q_len=max(q_lens, default=0),
                    pure_decode=not prefills, table_rows=tables.rows)
    if send is not None:
        send(host)
    step = place_step(host, tables)
    step.sampling, step.sampled_seqs = sampling, sampled_seqs
    step.has_drafts = any(s.draft_token_ids for s in sampled_seqs)
    return step


def place_step(host: HostStep, tables: BlockTables) -> StepInputs:
    """A packed step on the device (two copies), its block-table writes made."""
    tables.grow_to(host.table_rows)
    lp = _place(host.int64, host.int64_sizes, tables.device)
    ip = _place(host.int32, host.int32_sizes, tables.device)
    if ip[3].shape[0]:
        tables.table.view(-1, tables.width)[lp[6], lp[7]] = ip[3]  # rows of the [groups * rows, width] view
    runs, writes = _host_parts(host.int64, host.int64_sizes)[8:10]
    return StepInputs(
        ids=lp[0], positions=lp[1], slot_mapping=lp[2].view(tables.groups, -1), decode_rows=lp[3], decode_seq_lens=ip[0],
        prefill_rows=lp[4], prefill_cu_seqlens_q=ip[1], prefill_seq_lens=ip[2], sample_index=lp[5],
        num_decode_rows=host.num_decode_rows, decode_width=host.decode_width, prefill_width=host.prefill_width,
        decode_max_seq_len=host.decode_max_seq_len, prefill_max_q_len=host.prefill_max_q_len,
        pure_decode=host.pure_decode, lora_runs=[tuple(r) for r in runs.reshape(-1, 3).tolist()],
        lora_writes=[tuple(w) for w in writes.reshape(-1, 2).tolist()])


def _pack(parts: list, dtype) -> tuple[np.ndarray, list[int]]:
    """The parts as one array, each starting 16-byte aligned (where it starts decides which compiled
    variant of a kernel runs: Triton specializes on pointer alignment), and their sizes."""
    align = 16 // np.dtype(dtype).itemsize
    sizes = [len(p) for p in parts]
    starts = np.cumsum([0] + [-(-n // align) * align for n in sizes])
    host = np.zeros(int(starts[-1]), dtype=dtype)
    for start, part in zip(starts, parts):
        host[start:start + len(part)] = part
    return host, sizes


def _place(host: np.ndarray, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    """A packed array on the device in one copy, cut back into its parts."""
    return _host_parts(to_device(host, device), sizes)


def _host_parts(packed, sizes: list[int]) -> list:
    """A packed array (numpy or torch) cut back into its parts (views)."""
    align = 16 // packed.dtype.itemsize
    parts, start = [], 0
    for n in sizes:
        parts.append(packed[start:start + n])
        start += -(-n // align) * align
    return parts
