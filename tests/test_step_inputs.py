"""Block tables kept on the device from step to step (backend/worker/step_inputs.py): a step writes only
what changed, rows are reused, and whatever the history the device table holds every scheduled
sequence's current table. Also the step's inputs: two transfers, each part 16-byte aligned."""
import random
from types import SimpleNamespace

import pytest
import torch

from backend.core.request import Request, SamplingParams
from backend.core.step import ScheduledSeq, SchedulerOutput
from backend.kv.block_pool import NULL_BLOCK
from backend.worker.step_inputs import BlockTables, build_step


def seq(seq_id: str, table: list[int], *group_tables: list[int]):
    return SimpleNamespace(request=SimpleNamespace(seq_id=seq_id), block_table=table, group_tables=group_tables)


def check(tables: BlockTables, seqs, rows):
    for s, row in zip(seqs, rows):
        for g, table in enumerate((s.block_table, *s.group_tables)):
            got = tables.table[g, row, :len(table)].tolist()
            # a given-back entry (NULL_BLOCK) may hold any block id: no kernel reads it
            assert [x for x, b in zip(got, table) if b != NULL_BLOCK] == [b for b in table if b != NULL_BLOCK]


def test_a_step_writes_only_new_blocks_and_new_sequences():
    tables = BlockTables(4, 64, 16, torch.device("cpu"))
    a, b = seq("a", [7, 3, 9]), seq("b", [1])
    rows, ur, uc, uv = tables.assign([a, b])
    assert len(uv) == 4 and len(set(rows)) == 2
    check(tables_written(tables, rows, ur, uc, uv), [a, b], rows)
    rows2, ur, uc, uv = tables.assign([a, b])          # nothing changed
    assert rows2 == rows and uv == []
    a.block_table.append(11)                            # grown in place, as BlockManager.grow does
    rows3, ur, uc, uv = tables.assign([b, a])           # another order: the same rows
    assert rows3 == rows[::-1] and (ur, uc, uv) == ([rows[0]], [3], [11])


def tables_written(tables, rows, ur, uc, uv):
    if uv:
        tables.table.view(-1, tables.width)[torch.tensor(ur), torch.tensor(uc)] = torch.tensor(uv, dtype=torch.int32)
    return tables


def test_a_new_list_for_the_same_sequence_is_written_whole():
    """Preempted and readmitted: the block manager gives the sequence a new list."""
    tables = BlockTables(2, 8, 16, torch.device("cpu"))
    a = seq("a", [1, 2, 3])
    tables.assign([a])
    a2 = seq("a", [5, 6, 3])        # the same length and last block, another list
    rows, ur, uc, uv = tables.assign([a2])
    assert uc == [0, 1, 2] and uv == [5, 6, 3]
    a3 = seq("a", [8])
    assert tables.assign([a3])[3] == [8]


def test_random_histories_keep_the_device_table_right():
    rng = random.Random(4)
    tables = BlockTables(2, 40, 16, torch.device("cpu"))    # grows past 2 rows
    live: dict[str, list[int]] = {}
    writes = rewrite_all = 0
    for step in range(300):
        for sid in list(live):
            r = rng.random()
            if r < 0.1:
                del live[sid]                            # finished
            elif r < 0.15:
                live[sid] = [rng.randrange(100) for _ in range(rng.randint(1, 8))]   # preempted, back
            elif r < 0.5 and len(live[sid]) < 40:
                live[sid].append(rng.randrange(100))      # one more block
        while len(live) < rng.randint(1, 9):
            live[f"s{step}-{len(live)}"] = [rng.randrange(100) for _ in range(rng.randint(1, 30))]
        seqs = [seq(sid, t) for sid, t in live.items() if rng.random() < 0.9]    # some skip a step
        rng.shuffle(seqs)
        rows, ur, uc, uv = tables.assign(seqs)
        assert len(set(rows)) == len(seqs)
        writes += len(uv)
        rewrite_all += sum(len(s.block_table) for s in seqs)
        check(tables_written(tables, rows, ur, uc, uv), seqs, rows)
    assert writes < rewrite_all / 3, (writes, rewrite_all)   # a churn far above a real batch's


def test_the_step_inputs_cross_in_two_transfers_with_aligned_parts(monkeypatch):
    calls = []
    import backend.worker.step_inputs as si
    real = si.to_device
    monkeypatch.setattr(si, "to_device", lambda a, d: (calls.append(a.dtype), real(a, d))[1])
    tables = BlockTables(4, 8, 4, torch.device("cpu"))
    reqs = [Request(f"r{i}", list(range(3, 3 + 5 + i)), SamplingParams(max_tokens=4)) for i in range(3)]
    out = SchedulerOutput(decodes=[ScheduledSeq(reqs[0], 4, 1, block_table=[2, 5])],
                          prefills=[ScheduledSeq(reqs[1], 0, 6, block_table=[1, 3]),
                                    ScheduledSeq(reqs[2], 2, 5, block_table=[0, 4])])
    step = build_step(out, tables, empty_rows=3)
    assert sorted(map(str, calls)) == ["int32", "int64"]
    for t in (step.ids, step.positions, step.slot_mapping, step.decode_rows, step.decode_seq_lens,
              step.prefill_rows, step.prefill_cu_seqlens_q, step.prefill_seq_lens, step.sample_index):
        assert t.data_ptr() % 16 == 0
    assert step.ids.tolist()[:4] == [0, 0, 0, reqs[0].prompt_token_ids[4]]
    assert step.slot_mapping.tolist()[0][:4] == [-1, -1, -1, 5 * 4 + 0]
    assert step.decode_seq_lens.tolist() == [0, 0, 0, 5]
    assert step.prefill_cu_seqlens_q.tolist() == [0, 6, 11] and step.prefill_seq_lens.tolist() == [6, 7]
    assert step.sample_index.tolist() == [3, 9, 14] and step.num_decode_rows == 4 and not step.pure_decode
    rows = step.prefill_rows.tolist()
    assert tables.table[0, rows[1], :2].tolist() == [0, 4]


def test_every_kv_cache_group_gets_its_table_and_slots():
    """A model of several KV-cache groups (backend/kv/groups.py): a table per group in each row,
    written only where it changed, a local group's given-back entries written as block 0 (never
    read), and a slot mapping per group."""
    tables = BlockTables(2, 8, 4, torch.device("cpu"), groups=3)
    a = seq("a", [7, 3, 9], [1, 2, 5], [4, 6, 8])
    rows, ur, uc, uv = tables.assign([a])
    assert len(uv) == 9
    check(tables_written(tables, rows, ur, uc, uv), [a], rows)
    a.group_tables[0][0] = NULL_BLOCK          # slid out of the window: nothing to write
    a.group_tables[1].append(10)
    rows, ur, uc, uv = tables.assign([a])
    assert (uc, uv) == ([3], [10]) and ur == [2 * tables.rows + rows[0]]
    tables_written(tables, rows, ur, uc, uv)
    b = seq("b", [0, 1], [NULL_BLOCK, 11], [NULL_BLOCK, 12])   # a prefix hit: the window's block only
    rows, ur, uc, uv = tables.assign([a, b])
    assert set(uv) == {0, 1, 11, 12}          # b's given-back entries are written as block 0: a valid id
    check(tables_written(tables, rows, ur, uc, uv), [a, b], rows)
    with pytest.raises(ValueError, match="2 block tables for 3 KV-cache groups"):
        tables.assign([seq("c", [1], [2])])
    req = Request("r", list(range(3, 9)), SamplingParams(max_tokens=2))
    out = SchedulerOutput(prefills=[ScheduledSeq(req, 2, 4, block_table=[0, 5], group_tables=([1, 6], [2, 7]))])
    step = build_step(out, tables, empty_rows=1)
    assert step.slot_mapping.tolist() == [[-1, 2, 3, 20, 21], [-1, 6, 7, 24, 25], [-1, 10, 11, 28, 29]]
