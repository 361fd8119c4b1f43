"""The step plan's deltas and the worker's persistent batch (backend/sched/step_plan.py,
backend/worker/input_batch.py, backend/worker/step_inputs.py): a sequence's table is sent whole once,
then only what changed; rows are kept while a sequence is held; and whatever the history, the
worker's tables (device and host mirror) hold every held sequence's current tables. Also a step's
inputs: two transfers, each part 16-byte aligned, a slot mapping per KV-cache group."""
import random


import pytest
import torch

from backend.core.sampling_params import SamplingParams

from backend.core.request import Request
from backend.core.step import NewSeq, Row, StepPlan
from backend.kv.block_pool import NULL_BLOCK
from backend.sched.batch import ScheduledSeq, SchedulerOutput
from backend.sched.step_plan import WorkerView
from backend.worker.input_batch import BlockTables, InputBatch
from backend.worker.step_inputs import build_step


class Tables:
    """The block managers' tables as the planner reads them (KVCacheGroups.block_tables)."""

    def __init__(self, groups: int = 1):
        self.groups = groups
        self.tables: dict[str, list[list[int]]] = {}

    def block_tables(self, seq_id: str) -> list[list[int]]:
        return self.tables.get(seq_id, [[] for _ in range(self.groups)])


def request(seq_id: str, prompt_len: int = 5) -> Request:
    return Request(seq_id, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=4))


def step(view: WorkerView, batch: InputBatch, reqs: list, gone=(), preempted=()) -> StepPlan:
    out = SchedulerOutput(decodes=[ScheduledSeq(r, r.num_computed_tokens, 1) for r in reqs])
    plan = view.plan(out, list(gone), list(preempted))
    batch.apply(plan)
    return plan


def check(tables: Tables, batch: InputBatch, scheduled=None) -> None:
    """The tables of every sequence the last plan scheduled (default: every held one), as the
    sequence's state holds them and on the device, where they are not given back."""
    bt = batch.tables
    bt.table.view(-1, bt.width)[torch.tensor(bt._ur, dtype=torch.long), torch.tensor(bt._uc, dtype=torch.long)] = \
        torch.tensor(bt._uv, dtype=torch.int32)
    bt.take_writes()
    for sid, state in batch.seqs.items():
        if state.row < 0 or (scheduled is not None and sid not in scheduled):
            continue
        for g, table in enumerate(tables.block_tables(sid)):
            for got in (state.tables[g][:len(table)], bt.table[g, state.row, :len(table)].tolist()):
                # a given-back entry (NULL_BLOCK) may hold any block id: no kernel reads it
                assert [x for x, b in zip(got, table) if b != NULL_BLOCK] == [b for b in table if b != NULL_BLOCK]


def test_a_table_is_sent_whole_once_then_only_its_new_entries():
    tables, batch = Tables(), InputBatch(BlockTables(4, 64, 16, torch.device("cpu")))
    view = WorkerView(tables)
    a, b = request("a"), request("b")
    tables.tables = {"a": [[7, 3, 9]], "b": [[1]]}
    plan = step(view, batch, [a, b])
    assert [n.block_tables for n in plan.new_seqs] == [([7, 3, 9],), ([1],)] and not plan.updates
    check(tables, batch)
    plan = step(view, batch, [a, b])                      # nothing changed
    assert not plan.new_seqs and [u.blocks for u in plan.updates] == [(), ()]
    tables.tables["a"][0].append(11)                      # grown in place, as BlockManager.grow does
    a.output_token_ids.append(42)
    plan = step(view, batch, [b, a])                      # another order: the same rows
    update = {u.seq_id: u for u in plan.updates}
    assert update["a"].blocks == ((3, [11]),) and update["a"].new_token_ids == [42] and update["b"].blocks == ()
    assert batch["a"].output_token_ids == [42]
    check(tables, batch)


def test_a_new_list_for_the_same_sequence_is_sent_whole():
    """Trimmed after rejected drafts: the block manager gives the sequence a new list."""
    tables, batch = Tables(), InputBatch(BlockTables(2, 8, 16, torch.device("cpu")))
    view = WorkerView(tables)
    a = request("a")
    tables.tables["a"] = [[1, 2, 3]]
    step(view, batch, [a])
    tables.tables["a"] = [[5, 6, 3]]                      # the same length and last block, another list
    assert step(view, batch, [a]).updates[0].blocks == ((0, [5, 6, 3]),)
    check(tables, batch)


def test_random_histories_keep_the_worker_tables_right():
    rng = random.Random(4)
    tables, batch = Tables(), InputBatch(BlockTables(2, 40, 16, torch.device("cpu")))    # grows past 2 rows
    view = WorkerView(tables)
    live: dict[str, Request] = {}
    writes = rewrite_all = 0
    for n in range(300):
        gone, preempted = [], []
        for sid in list(live):
            r = rng.random()
            if r < 0.1:
                gone.append(live.pop(sid))              # finished
                del tables.tables[sid]
            elif r < 0.15:
                preempted.append(live[sid])              # preempted, back with a new table
                tables.tables[sid] = [[rng.randrange(100) for _ in range(rng.randint(1, 8))]]
            elif r < 0.5 and len(tables.tables[sid][0]) < 40:
                tables.tables[sid][0].append(rng.randrange(100))      # one more block
        while len(live) < rng.randint(1, 9):
            sid = f"s{n}-{len(live)}"
            live[sid] = request(sid)
            tables.tables[sid] = [[rng.randrange(100) for _ in range(rng.randint(1, 30))]]
        scheduled = [r for r in live.values() if rng.random() < 0.9]    # some skip a step
        rng.shuffle(scheduled)
        before = len(batch.tables._uv)
        plan = step(view, batch, scheduled, gone, preempted)
        held = [batch[r.seq_id] for r in scheduled]
        assert len({s.row for s in held}) == len(held) and min(s.row for s in held) >= 0
        assert set(batch.seqs) == set(view.known) and not set(plan.finished_ids) & set(batch.seqs)
        writes += len(batch.tables._uv) - before
        rewrite_all += sum(len(tables.tables[r.seq_id][0]) for r in scheduled)
        check(tables, batch, {r.seq_id for r in scheduled})
    assert writes < rewrite_all / 3, (writes, rewrite_all)   # a churn far above a real batch's


def new_seq(seq_id: str, prompt: list[int], *tables: list[int], computed: int = 0) -> NewSeq:
    return NewSeq(seq_id, prompt, [], SamplingParams(max_tokens=4), 0, 0, (), [], None, tables, computed)


def test_the_step_inputs_cross_in_two_transfers_with_aligned_parts(monkeypatch):
    calls = []
    import backend.worker.step_inputs as si
    real = si.to_device
    monkeypatch.setattr(si, "to_device", lambda a, d: (calls.append(a.dtype), real(a, d))[1])
    batch = InputBatch(BlockTables(4, 8, 4, torch.device("cpu")))
    prompts = [list(range(3, 3 + 5 + i)) for i in range(3)]
    plan = StepPlan(new_seqs=[new_seq("r0", prompts[0], [2, 5], computed=4), new_seq("r1", prompts[1], [1, 3]),
                              new_seq("r2", prompts[2], [0, 4], computed=2)],
                    decodes=[Row("r0", 4, 1)], prefills=[Row("r1", 0, 6), Row("r2", 2, 5)])
    batch.apply(plan)
    step = build_step(plan, batch, empty_rows=3)
    assert sorted(map(str, calls)) == ["int32", "int64"]
    for t in (step.ids, step.positions, step.slot_mapping, step.decode_rows, step.decode_seq_lens,
              step.prefill_rows, step.prefill_cu_seqlens_q, step.prefill_seq_lens, step.sample_index):
        assert t.data_ptr() % 16 == 0
    assert step.ids.tolist()[:4] == [0, 0, 0, prompts[0][4]]
    assert step.slot_mapping.tolist()[0][:4] == [-1, -1, -1, 5 * 4 + 0]
    assert step.decode_seq_lens.tolist() == [0, 0, 0, 5]
    assert step.prefill_cu_seqlens_q.tolist() == [0, 6, 11] and step.prefill_seq_lens.tolist() == [6, 7]
    assert step.sample_index.tolist() == [3, 9, 14] and step.num_decode_rows == 4 and not step.pure_decode
    rows = step.prefill_rows.tolist()
    assert batch.tables.table[0, rows[1], :2].tolist() == [0, 4]   # the table writes crossed with the inputs
    assert [s.seq_id for s in step.sampling] == ["r0", "r1", "r2"]


def test_every_kv_cache_group_gets_its_table_and_slots():
    """A model of several KV-cache groups (backend/kv/groups.py): a table per group in each row,
    written only where it changed, a local group's given-back entries written as block 0 (never
    read), and a slot mapping per group."""
    tables, batch = Tables(groups=3), InputBatch(BlockTables(2, 8, 4, torch.device("cpu"), groups=3))
    view = WorkerView(tables)
    a = request("a")
    tables.tables["a"] = [[7, 3, 9], [1, 2, 5], [4, 6, 8]]
    step(view, batch, [a])
    assert len(batch.tables._uv) == 9
    check(tables, batch)
    tables.tables["a"][1][0] = NULL_BLOCK          # slid out of the window: nothing to write
    tables.tables["a"][2].append(10)
    plan = step(view, batch, [a])
    assert plan.updates[0].blocks == ((3, []), (3, []), (3, [10]))
    assert (batch.tables._uc, batch.tables._uv) == ([3], [10]) and batch.tables._ur == [2 * batch.tables.rows + batch["a"].row]
    check(tables, batch)
    b = request("b")
    tables.tables["b"] = [[0, 1], [NULL_BLOCK, 11], [NULL_BLOCK, 12]]   # a prefix hit: the window's block only
    step(view, batch, [a, b])
    assert set(batch.tables._uv) == {0, 1, 11, 12}   # b's given-back entries are written as block 0: a valid id
    check(tables, batch)
    plan = StepPlan(new_seqs=[new_seq("r", list(range(3, 9)), [0, 5], [1, 6], [2, 7], computed=2)],
                    prefills=[Row("r", 2, 4)])
    batch.apply(plan)
    assert build_step(plan, batch, empty_rows=1).slot_mapping.tolist() == [
        [-1, 2, 3, 20, 21], [-1, 6, 7, 24, 25], [-1, 10, 11, 28, 29]]


def test_a_plan_may_not_name_a_held_sequence_new_nor_cut_into_a_prompt():
    batch = InputBatch(BlockTables(2, 8, 4, torch.device("cpu")))
    batch.apply(StepPlan(new_seqs=[new_seq("a", [3, 4, 5], [1])]))
    with pytest.raises(ValueError, match="already held"):
        batch.apply(StepPlan(new_seqs=[new_seq("a", [3, 4, 5], [1])]))
    with pytest.raises(ValueError, match="cut into the prompt"):
        batch["a"].set_tokens(2, [9])
    batch["a"].set_tokens(-1, [9, 10])
    batch["a"].set_tokens(4, [11])
    assert batch["a"].all_token_ids == [3, 4, 5, 9, 11]
    with pytest.raises(ValueError, match="exceeds the 8 that max_model_len allows"):
        batch.tables.write(batch["a"].row, 0, 5, [1, 2, 3, 4])

