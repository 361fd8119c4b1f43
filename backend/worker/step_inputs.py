"""One step's flat inputs, built on the host from the persistent batch and sent to the device in
two transfers.

The flat batch is [empty rows][decode rows][prefill chunks]. Empty rows pad the step to a size the
device path wants (a GEMM bucket on the CPU fast path, a captured CUDA graph's batch size): decode
rows of empty sequences, stored nowhere (slot -1), attending to nothing (length 0: the kernels
give zeros), never sampled. Padding rows of padded batches (static, dynamic) go through the model
like the others, one-token rows with the decodes and longer ones with the prefills; they read
their member's cache but are never stored nor sampled.

Everything a row needs comes from its sequence's state (input_batch.py): its tokens, its block
tables (the slots), its row of the device tables (gathered on the device). The step's table writes
(input_batch.BlockTables) travel in the same two transfers. Plain ints throughout: most rows are
one decode token, where numpy costs more than it saves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from backend.core.step import StepPlan
from backend.worker.device import to_device
from backend.worker.input_batch import InputBatch
from backend.worker.lora.segments import adapter_runs, order_by_adapter
from backend.worker.prompt_logprobs import chunk_rows

PAD_TOKEN_ID = 0  # what padding and empty rows feed the model; their results are discarded


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
    sampling: list = field(default_factory=list)      # the SeqStates that sample, in sample_index order
    sampled_rows: list = field(default_factory=list)  # their plan Rows (a verify row has 1 + drafts rows in sample_index)
    has_drafts: bool = False          # some row verifies drafts (rejection.py samples the step)
    prompt_rows: list = field(default_factory=list)  # prompt_logprobs.py: the prompt positions to score
    pool_rows: list = field(default_factory=list)  # pooler.py: (SeqState, first row, rows, start, last chunk)
    pooled: dict = field(default_factory=dict)  # pooler.py: seq_id -> Sampled with its pooled output
    # LoRA: the adapter runs (first row, end row, slot) and the slot writes (slot, load id) rank 0
    # made for them (backend/worker/lora/manager.py)
    lora_runs: list = field(default_factory=list)
    lora_writes: list = field(default_factory=list)


@dataclass
class HostStep:
    """A step's integers packed on the host (one int64 and one int32 array, parts 16-byte aligned)
    with the facts the launches need: what `place_step` puts on the device."""
    int64: np.ndarray
    int64_sizes: list[int]   # ids, positions, slots (per group), decode rows, prefill rows, sample index, table writes (row, col)
    int32: np.ndarray
    int32_sizes: list[int]   # decode lengths, prefill cu_seqlens, prefill lengths, table writes (value)
    num_decode_rows: int
    decode_width: int
    prefill_width: int
    decode_max_seq_len: int
    prefill_max_q_len: int
    pure_decode: bool


def step_rows(plan: StepPlan, batch: InputBatch, verify_as_decode: bool) -> tuple[list, list]:
    """The plan's rows in the flat batch's order: (decode rows, prefill rows), each grouped by LoRA
    adapter so an adapter's rows are row ranges in every layer. `verify_as_decode`: a verify row's
    1 + k queries attend as 1 + k decode rows of one sequence (lengths start + 1 .. start + 1 + k:
    causal, its K/V stored first like every row's) rather than as a prefill chunk; the CPU's decode
    kernel reads the cache where it lies, where prefill attention copies the context."""
    verify = [r for r in plan.prefills if r.draft_token_ids] if verify_as_decode else []
    lora_of = (lambda r: batch.seqs[r.seq_id].lora_name)  # noqa: E731
    decodes = order_by_adapter(plan.decodes + [r for r in plan.padding if r.num_new_tokens == 1] + verify, lora_of)
    prefills = order_by_adapter([r for r in plan.prefills if not (verify and r.draft_token_ids)]
                                + [r for r in plan.padding if r.num_new_tokens > 1], lora_of)
    return decodes, prefills


def build_step(plan: StepPlan, batch: InputBatch, empty_rows: int, verify_as_decode: bool = False,
               lora=None, lora_plan=None) -> StepInputs:
    """A plan (already applied to `batch`) -> StepInputs: the host work of a step, then two
    host-to-device copies (the int64 and the int32 arrays, the table writes among them). `lora`:
    the LoRAManager that gives the adapter runs their slots (its `assign`); `lora_plan`: the runs
    and writes rank 0 made (a tensor-parallel rank follows them)."""
    decodes, prefills = step_rows(plan, batch, verify_as_decode)
    seqs, tables = batch.seqs, batch.tables
    bs, groups = tables.block_size, tables.groups
    ids: list[int] = [PAD_TOKEN_ID] * empty_rows
    positions: list[int] = [0] * empty_rows
    slots: list[list[int]] = [[-1] * empty_rows for _ in range(groups)]  # per KV-cache group
    d_lens: list[int] = [0] * empty_rows
    d_rows: list[int] = [0] * empty_rows
    sample_index: list[int] = []
    sampling, sampled_rows, prompt_rows, pool_rows = [], [], [], []
    end = empty_rows
    for r in decodes + prefills:  # plain ints: most rows are one decode token, where numpy costs more
        s = seqs[r.seq_id]
        start, n = r.start, r.num_new_tokens
        positions += range(start, start + n)
        end += n
        if r.padding:
            ids += [PAD_TOKEN_ID] * n
            for group_slots in slots:
                group_slots += [-1] * n
        else:
            drafts = r.draft_token_ids  # a verify row: its last token, then its drafts
            ids += s.token_ids(start, start + n - len(drafts))
            ids += drafts
            for group_slots, table in zip(slots, s.tables):
                group_slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if not drafts and s.params.prompt_logprobs is not None:
                rows = chunk_rows(s, end - n, start, n)
                if rows:
                    prompt_rows.append(rows)
            if s.pooling is not None:  # pooled, never sampled (pooler.py)
                pool_rows.append((s, end - n, n, start, r.samples))
            elif r.samples:
                sample_index += range(end - 1 - len(drafts), end)  # a verify row keeps every position's logits
                sampling.append(s)
                sampled_rows.append(r)
    for r in decodes:  # each query of a decode row (a verify row's k + 1) reads its sequence's context so far
        row = seqs[r.seq_id].row
        d_lens += range(r.start + 1, r.start + 1 + r.num_new_tokens)
        d_rows += [row] * r.num_new_tokens
    q_lens = [r.num_new_tokens for r in prefills]
    p_lens = [r.start + r.num_new_tokens for r in prefills]
    cu = [0] * (len(prefills) + 1)
    for i, q in enumerate(q_lens):
        cu[i + 1] = cu[i] + q
    ur, uc, uv = tables.take_writes()
    if lora_plan is not None:
        lora_runs, lora_writes = lora_plan
    elif lora is not None:
        lora_runs, lora_writes = lora.assign(adapter_runs(empty_rows, decodes + prefills, lambda r: seqs[r.seq_id].lora_name))
    else:
        lora_runs, lora_writes = [], []
    int64, int64_sizes = _pack([ids, positions, [x for group_slots in slots for x in group_slots], d_rows,
                                [seqs[r.seq_id].row for r in prefills], sample_index, ur, uc,
                                [v for run in lora_runs for v in run], [v for w in lora_writes for v in w]], np.int64)
    int32, int32_sizes = _pack([d_lens, cu, p_lens, uv], np.int32)
    width = tables.width
    max_d = max(d_lens, default=0)
    host = HostStep(int64, int64_sizes, int32, int32_sizes, num_decode_rows=len(d_lens),
                    decode_width=max(1, min(-(-max_d // bs), width)),
                    prefill_width=max([1] + [min(-(-n // bs), width) for n in p_lens]),
                    decode_max_seq_len=max_d, prefill_max_q_len=max(q_lens, default=0), pure_decode=not prefills)
    step = place_step(host, tables)
    step.sampling, step.sampled_rows = sampling, sampled_rows
    step.has_drafts = any(r.draft_token_ids for r in sampled_rows)
    step.prompt_rows, step.pool_rows = prompt_rows, pool_rows
    return step


def place_step(host: HostStep, tables) -> StepInputs:
    """A packed step on the device (two copies), its block-table writes made."""
    lp = _place(host.int64, host.int64_sizes, tables.device)
    ip = _place(host.int32, host.int32_sizes, tables.device)
    if ip[3].shape[0]:
        tables.table.view(-1, tables.width)[lp[6], lp[7]] = ip[3]  # rows of the [groups * rows, width] view
    lora_runs, lora_writes = [], []
    if any(host.int64_sizes[8:10]):  # (a step with adapter rows: their runs and slot writes read back)
        runs, writes = _host_parts(host.int64, host.int64_sizes)[8:10]
        lora_runs = [tuple(r) for r in runs.reshape(-1, 3).tolist()]
        lora_writes = [tuple(w) for w in writes.reshape(-1, 2).tolist()]
    return StepInputs(
        ids=lp[0], positions=lp[1], slot_mapping=lp[2].view(tables.groups, -1), decode_rows=lp[3], decode_seq_lens=ip[0],
        prefill_rows=lp[4], prefill_cu_seqlens_q=ip[1], prefill_seq_lens=ip[2], sample_index=lp[5],
        num_decode_rows=host.num_decode_rows, decode_width=host.decode_width, prefill_width=host.prefill_width,
        decode_max_seq_len=host.decode_max_seq_len, prefill_max_q_len=host.prefill_max_q_len,
        pure_decode=host.pure_decode, lora_runs=lora_runs, lora_writes=lora_writes)


def _pack(parts: list, dtype) -> tuple[np.ndarray, list[int]]:
    """The parts as one array, each starting 16-byte aligned (where it starts decides which compiled
    variant of a kernel runs: Triton specializes on pointer alignment), and their sizes."""
    align = 16 // np.dtype(dtype).itemsize
    sizes = [len(p) for p in parts]
    flat: list[int] = []
    for part, n in zip(parts, sizes):  # one conversion of one list: a step's parts are a few ints each
        flat += part
        flat += [0] * (-n % align)
    return np.array(flat, dtype=dtype), sizes


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
