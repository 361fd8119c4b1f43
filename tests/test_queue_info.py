"""Where a request stands (`queue_info`, the engine side of `return_queue_info`), on the in-process
engine: a request behind a blocked head is told its place, then its reserved step once it is the
head, before its first token, and both are right; once it runs, the KV blocks reserved for it;
and its times, in order."""
import pytest

from backend import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def engine(default_model_dir):
    # 16 blocks of 16 tokens: A (7 blocks to completion) runs; H (10) cannot start beside it; R (8)
    # fits beside A but would still hold blocks when A ends, where H's 10 must fit: R waits too.
    return LLM(str(default_model_dir), max_tokens_in_paged_kv_cache=16 * BLOCK, kv_block_size=BLOCK,
               max_num_seqs=8).engine


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run_behind_a_blocked_head(engine):
    engine.add_request("A", list(range(3, 11)), greedy(100))
    outs = {"A": [], "H": [], "R": []}
    for o in engine.step():
        outs[o.request_id].append(o)
    engine.add_request("H", list(range(20, 28)), greedy(150), queue_info=True)
    engine.add_request("R", list(range(40, 48)), greedy(120), queue_info=True)
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def test_a_request_behind_a_blocked_head_learns_its_place_and_reserved_step_and_they_are_right(engine):
    outs = run_behind_a_blocked_head(engine)
    r, h = outs["R"], outs["H"]
    first_token = next(i for i, o in enumerate(r) if o.new_token_ids)
    before = r[:first_token]
    assert before and all(not o.new_token_ids and o.queue is not None for o in before)
    # behind H while H waits: place 1, no reservation (EASY backfilling reserves for the head only)
    behind = [o.queue for o in before if o.queue.position == 1]
    assert behind and all(q.reserved_step is None for q in behind)
    h_start = h[-1].queue.first_scheduled_step
    assert all(q.engine_step < h_start for q in behind)
    # H started: R is the head, told the step its start is reserved for, before its first token
    head = [o.queue for o in before if o.queue.position == 0]
    assert head and all(q.reserved_step is not None and q.engine_step >= h_start for q in head)
    reserved = min(q.reserved_step for q in head)
    started = r[first_token].queue
    assert started.position == -1 and started.first_scheduled_step is not None
    assert started.first_scheduled_step <= reserved, "R started after the step it was reserved for"
    # with ignore_eos the worst case is what happens: R starts exactly at its reserved step
    assert started.first_scheduled_step == reserved
    assert started.kv_blocks_reserved == -(-(8 + 120 - 1) // BLOCK)  # 8 blocks to completion
    # the reports came when something changed, not at every step
    assert len(before) < 10
    # every output of a followed request carries its standing; others carry none
    assert all(o.queue is not None for o in r + h) and all(o.queue is None for o in outs["A"])
    assert engine.stats()["kv_blocks_used"] == 0


def test_times_are_in_order_and_the_last_output_has_them_all(engine):
    outs = run_behind_a_blocked_head(engine)
    q = outs["R"][-1].queue
    assert outs["R"][-1].finished
    assert q.arrival_time <= q.first_scheduled_time <= q.first_token_time <= q.finished_time
    waits = [o.queue for o in outs["R"] if not o.new_token_ids]
    assert all(w.first_scheduled_time is None and w.finished_time is None for w in waits)


def test_queue_info_does_not_change_what_is_generated(engine):
    engine.add_request("plain", list(range(40, 48)), greedy(12))
    engine.add_request("told", list(range(40, 48)), greedy(12), queue_info=True)
    got = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o
    assert got["told"].token_ids == got["plain"].token_ids and got["told"].text == got["plain"].text
