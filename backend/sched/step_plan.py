"""What the worker knows of each sequence, and the step plan that tells it the rest (backend/core/step.py).

The scheduler forms each step's batch over live requests (batch.py); `WorkerView` turns it into the
plan the worker runs: a sequence it has not seen is sent whole (`NewSeq`), once; one it holds gets
only what changed since (`SeqUpdate`: the tokens appended since it last ran, its computed count, the
block-table entries written since). A block table that only grew sends its new entries; one that
changed otherwise (trimmed after rejected drafts, a new list) is sent from the first entry that may
differ. The sequences that left the scheduler since the last plan are named once (`finished_ids`),
the preempted too (their blocks are gone; they come back `resumed`, tables whole).
"""
from __future__ import annotations

from typing import Optional

from backend.core.request import Request
from backend.core.step import GrammarMasks, NewSeq, Row, SeqUpdate, StepPlan
from backend.kv.groups import KVCacheGroups
from backend.sched.batch import SchedulerOutput


class _Sent:
    """What the worker was last told of a sequence: how many of its tokens, and per group the table
    list it was sent from, its entries sent and the last of them (None: no table, preempted)."""
    __slots__ = ("tokens", "tables")

    def __init__(self, tokens: int, tables: Optional[list]):
        self.tokens, self.tables = tokens, tables


def _table_delta(held: Optional[tuple], table: list[int]) -> Optional[tuple[int, list[int]]]:
    """(first entry to write, entries) for a table the worker holds as `held` (None: nothing)."""
    n = len(table)
    start = 0
    if held is not None and held[0] is table and held[1] <= n and (held[1] == 0 or table[held[1] - 1] == held[2]):
        start = held[1]
    return (start, table[start:]) if n > start or start == 0 else None


class WorkerView:
    def __init__(self, blocks: KVCacheGroups):
        self.blocks = blocks
        self.known: dict[str, _Sent] = {}

    def plan(self, batch: SchedulerOutput, gone: list[Request], preempted: list[Request],
             grammar: Optional[GrammarMasks] = None, kv_copies=None) -> StepPlan:
        plan = StepPlan(grammar=grammar, kv_copies=kv_copies)
        for req in gone:
            if self.known.pop(req.seq_id, None) is not None:
                plan.finished_ids.append(req.seq_id)
        for req in preempted:
            sent = self.known.get(req.seq_id)
            if sent is not None and sent.tables is not None:
                sent.tables = None
                plan.preempted_ids.append(req.seq_id)
        seen: set[str] = set()
        for rows, into in ((batch.decodes, plan.decodes), (batch.prefills, plan.prefills), (batch.padding, plan.padding)):
            for s in rows:
                req = s.request
                if req.seq_id not in seen:
                    seen.add(req.seq_id)
                    self._describe(req, plan)
                into.append(Row(req.seq_id, s.start, s.num_new_tokens, s.samples, s.padding,
                                list(s.draft_token_ids), s.draft_probs))
        return plan

    def _describe(self, req: Request, plan: StepPlan) -> None:
        tables = self.blocks.block_tables(req.seq_id)
        sent = self.known.get(req.seq_id)
        if sent is None:
            plan.new_seqs.append(NewSeq(req.seq_id, list(req.prompt_token_ids), list(req.output_token_ids), req.params,
                                        req.seed, req.index, req.eos_token_ids, req.bad_words_ids, req.lora_name,
                                        tuple(list(t) for t in tables), req.num_computed_tokens))
            self.known[req.seq_id] = _Sent(req.num_tokens, [(t, len(t), t[-1] if t else None) for t in tables])
            return
        resumed = sent.tables is None
        held = sent.tables or [None] * len(tables)
        deltas = [_table_delta(h, t) for h, t in zip(held, tables)]
        blocks = ()
        if any(d is not None for d in deltas):
            blocks = tuple(d if d is not None else (len(t), []) for d, t in zip(deltas, tables))
        new = req.token_ids(sent.tokens, req.num_tokens) if req.num_tokens > sent.tokens else []
        plan.updates.append(SeqUpdate(req.seq_id, req.num_computed_tokens, new, -1, blocks, resumed))
        sent.tokens = req.num_tokens
        sent.tables = [(t, len(t), t[-1] if t else None) for t in tables]

    def forget(self) -> list[str]:
        """Everything the worker holds (the worker was reset): the ids it should drop."""
        ids = list(self.known)
        self.known.clear()
        return ids
