"""What the worker knows of each sequence, and the step plan that tells it the rest (backend/core/step.py).

The scheduler forms each step's batch over live requests (batch.py); `WorkerView` turns it into the
plan the worker runs: a sequence it has not seen is sent whole (`NewSeq`), once; one it holds gets
only what changed since (`SeqUpdate`: the tokens appended since it last ran, its computed count, the
block-table entries written since). A block table that only grew sends its new entries; one that
changed otherwise (trimmed after rejected drafts, a new list) is sent whole again. The sequences that left the scheduler since the last plan are named once (`finished_ids`),
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
    __slots__ = ("tokens", "tables", "cut")

    def __init__(self, tokens: int, tables: Optional[list]):
        self.tokens, self.tables = tokens, tables
        self.cut = -1  # >= 0: its tokens from there on were replaced (beam search): sent again from there


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
                into.append(Row(req.seq_id, s.start, s.num_new_tokens, s.samples, s.padding, s.draft_token_ids,
                                s.draft_probs))
        return plan

    def _describe(self, req: Request, plan: StepPlan) -> None:
        tables = self.blocks.block_tables(req.seq_id)
        sent = self.known.get(req.seq_id)
        num_tokens = req.num_tokens
        if sent is None:
            plan.new_seqs.append(NewSeq(req.seq_id, list(req.prompt_token_ids), list(req.output_token_ids), req.params,
                                        req.seed, req.index, req.eos_token_ids, req.bad_words_ids, req.lora_name,
                                        tuple(list(t) for t in tables), req.num_computed_tokens, req.pooling,
                                        mm_items=tuple(req.mm_items)))
            self.known[req.seq_id] = _Sent(num_tokens, [(t, len(t), t[-1] if t else None) for t in tables])
            return
        new = req.token_ids(sent.tokens, num_tokens) if num_tokens > sent.tokens else []
        sent.tokens, cut, sent.cut = num_tokens, sent.cut, -1
        held, resumed = sent.tables, sent.tables is None
        if resumed:
            blocks = tuple((0, list(t)) for t in tables)
            sent.tables = [(t, len(t), t[-1] if t else None) for t in tables]
        else:
            blocks = ()
            for g, t in enumerate(tables):
                table, n_sent, last = held[g]
                n = len(t)
                if table is t and n_sent <= n and (n_sent == 0 or t[n_sent - 1] == last):
                    if n == n_sent:
                        continue  # unchanged (entries given back before the window are never read)
                    start = n_sent
                else:
                    start = 0  # another list (trimmed, or a new one): from the first entry
                if not blocks:
                    blocks = [(len(x), []) for x in tables]
                blocks[g] = (start, t[start:])
                held[g] = (t, n, t[-1] if t else None)
            blocks = tuple(blocks)
        plan.updates.append(SeqUpdate(req.seq_id, req.num_computed_tokens, new, cut, blocks, resumed))

    def rewrite(self, seq_id: str, start: int) -> None:
        """seq_id's tokens from `start` on were replaced (a beam took another's history): the next
        plan cuts the worker's copy there and sends them again."""
        sent = self.known.get(seq_id)
        if sent is not None and start < sent.tokens:
            sent.tokens = start
            sent.cut = start if sent.cut < 0 else min(sent.cut, start)

    def forget(self) -> list[str]:
        """Everything the worker holds (the worker was reset): the ids it should drop."""
        ids = list(self.known)
        self.known.clear()
        return ids
