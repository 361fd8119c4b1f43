"""Backfilled admission under guaranteed_no_evict, request priority and prefix-aware reservation.

The head-of-line case from TensorRT-LLM #2866, reproduced on the scheduler: a head that does not fit
no longer blocks small requests that cannot delay it; a property test over random workloads checks
that nothing is preempted, no block leaks or is owned twice, and no head starts later than its
reservation."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.outputs import Sampled
from backend.request import Request, RequestStatus, SamplingParams
from backend.scheduler import Scheduler

EOS = 0


def make(num_blocks, block_size=4, budget=64, max_seqs=8, backfill=True, policy="guaranteed_no_evict",
         reuse=False):
    cfg = EngineConfig(model_path="unused", kv_block_size=block_size, max_num_batched_tokens=budget,
                       max_num_seqs=max_seqs, enable_backfill=backfill, batch_scheduler_policy=policy,
                       enable_kv_cache_reuse=reuse)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching=reuse), max_model_len=10_000)


def req(rid, prompt_len, max_tokens, priority=0, first=1):
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   (EOS,), arrival_time=0.0, priority=priority)


def step(sched, token=7, eos_rate=0.0, rng=None):
    out = sched.schedule(0.0)
    sampled = {s.request.seq_id: Sampled(EOS if rng and rng.random() < eos_rate else token)
               for s in out.seqs if s.samples}
    sched.postprocess(out, sampled, 0.0)
    sched.check_integrity()
    return out


def run_head_of_line(backfill):
    """10 blocks; A runs holding 3; the head needs 9; five 1-block requests wait behind it."""
    sched = make(num_blocks=10, backfill=backfill)
    a = req("A", 4, 9)
    sched.add(a)
    step(sched)
    sched.add(req("head", 4, 33))
    smalls = [req(f"s{i}", 2, 3) for i in range(5)]
    for s in smalls:
        sched.add(s)
    started, n = {}, 1
    while sched.has_work:
        n += 1
        out = step(sched)
        for s in out.seqs:
            started.setdefault(s.request.request_id, n)
        if sched.reservation is not None:
            started.setdefault("reservation", sched.reservation[1])
    return sched, started, a


def test_strict_order_blocks_the_small_requests_behind_the_head():
    sched, started, _ = run_head_of_line(backfill=False)
    assert all(started[f"s{i}"] >= started["head"] for i in range(5))
    assert sched.num_backfilled == 0


def test_backfill_starts_the_small_requests_at_once_and_the_head_by_its_reservation():
    sched, started, a = run_head_of_line(backfill=True)
    assert all(started[f"s{i}"] == 2 for i in range(5)), started  # the step the head was refused
    assert started["head"] <= started["reservation"]
    assert sched.num_backfilled == 5 and sched.num_preemptions == 0
    assert sched.blocks.num_used_blocks == 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), num_blocks=st.integers(8, 48), block_size=st.sampled_from([1, 4, 16]),
       max_seqs=st.integers(1, 8), budget=st.integers(9, 120), n_requests=st.integers(1, 30),
       eos_rate=st.sampled_from([0.0, 0.05]), abort_rate=st.sampled_from([0.0, 0.05]), reuse=st.booleans())
def test_backfill_never_preempts_leaks_or_delays_a_head_past_its_reservation(
        seed, num_blocks, block_size, max_seqs, budget, n_requests, eos_rate, abort_rate, reuse):
    rng = random.Random(seed)
    budget = max(budget, max_seqs + 1)
    sched = make(num_blocks, block_size, budget, max_seqs, reuse=reuse)
    shared = [rng.randrange(1, 100) for _ in range(40)]
    pending = []
    for i in range(n_requests):
        prompt, max_tokens = rng.randint(1, 50), rng.choice([rng.randint(1, 8), rng.randint(1, 80)])
        head = shared[:rng.randint(0, prompt)] if reuse else []
        r = Request(f"r{i}", head + [rng.randrange(1, 100) for _ in range(prompt - len(head))],
                    SamplingParams(max_tokens=max_tokens, temperature=0), (EOS,), arrival_time=0.0)
        try:
            sched.check_fits(r.num_prompt_tokens, max_tokens)
        except ValueError:
            continue
        pending.append(r)
    reservations: dict[str, int] = {}
    added, ended = [], set()
    for _ in range(20_000):
        while pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
            added.append(sched.waiting[len(sched.waiting) - 1])
        if added and rng.random() < abort_rate:
            victim = rng.choice(added)
            if sched.abort(victim.request_id):
                ended.add(victim.request_id)
        waiting_before = {r.seq_id for r in sched.waiting}
        out = step(sched, eos_rate=eos_rate, rng=rng)
        for s in out.seqs:  # started this step: never later than a reservation it held as head
            if s.request.seq_id in waiting_before and s.request.seq_id in reservations:
                assert sched.steps <= reservations[s.request.seq_id], "a head started past its reservation"
        if sched.reservation is not None:
            sid, at = sched.reservation
            reservations[sid] = min(reservations.get(sid, at), at)
        for r in added:
            if r.status.finished:
                ended.add(r.request_id)
        assert sched.num_preemptions == 0
        if not pending and not sched.has_work:
            break
    assert not sched.has_work, "requests starved"
    assert ended == {r.request_id for r in added}
    assert sched.blocks.num_used_blocks == 0


def test_shared_prefix_blocks_are_reserved_once():
    """8 requests sharing a 400-token prefix in a 64-block cache: reserved per holder they ran
    2 at a time; reserved once, all 8 run together."""
    sched = make(num_blocks=64, block_size=16, budget=512, max_seqs=8, reuse=True)
    prefix = list(range(1000, 1400))
    family = [Request(f"p{i}", prefix + [i + 1] * 8, SamplingParams(max_tokens=40, temperature=0), (EOS,),
                      arrival_time=0.0) for i in range(8)]
    sched.add(family[0])
    step(sched)  # the first computes (and publishes) the prefix
    for r in family[1:]:
        sched.add(r)
    most = 0
    while sched.has_work:
        step(sched)
        most = max(most, len(sched.running))
    assert most == 8
    assert sched.blocks.num_used_blocks == 0


def test_the_more_urgent_waiting_request_is_admitted_first_and_nothing_is_preempted():
    sched = make(num_blocks=6, block_size=4, max_seqs=8)
    sched.add(req("running", 4, 12))  # 4 blocks of 6
    step(sched)
    for rid, prio in (("late-low", 5), ("urgent", -1), ("mid", 2)):
        sched.add(req(rid, 4, 5, priority=prio))
    assert [r.request_id for r in sched.waiting] == ["urgent", "mid", "late-low"]
    order = []
    while sched.has_work:
        out = step(sched)
        order += [s.request.request_id for s in out.prefills if s.start == 0]
    assert order.index("urgent") < order.index("mid") < order.index("late-low")
    assert sched.num_preemptions == 0


def test_under_max_utilization_an_urgent_request_preempts_the_least_urgent():
    sched = make(num_blocks=4, block_size=4, max_seqs=8, policy="max_utilization")
    low = req("low", 8, 7, priority=3)
    sched.add(low)
    step(sched)
    step(sched)
    sched.add(req("urgent", 8, 4, priority=0))
    out = step(sched)
    assert low in out.preempted and low.status is RequestStatus.WAITING
    assert [s.request.request_id for s in out.seqs] == ["urgent"]
    while sched.has_work:
        step(sched)
    assert sched.blocks.num_used_blocks == 0


def test_worst_case_finish_counts_the_prompt_work_of_requests_served_first():
    """A request is served after every older one: their prompt tokens beyond one per step can take
    the whole budget, so they add to its worst-case finish, and a newly started request's too."""
    from backend.backfill import Window, finish_bounds, own_work
    old = req("old", 40, 5)  # 40 prompt tokens to compute: 39 beyond one per step
    young = req("young", 4, 10)  # decoding: 2 tokens out, the last one not yet computed
    young.output_token_ids = [7, 7]
    young.num_computed_tokens = 5
    assert own_work(old) == 40 + 5 - 1 and own_work(young) == 1 + (10 - 2) - 1
    assert finish_bounds([old, young]) == [44, 39 + 8]
    small = req("small", 2, 3)  # own work 4
    window = Window(head=req("head", 4, 50), reserve_by=10, spare_blocks=0, spare_slots=0, ahead=39)
    assert not window.admits(small, need=1), "it could still run at the reservation"
    assert Window(head=window.head, reserve_by=10, spare_blocks=0, spare_slots=0, ahead=0).admits(small, need=1)


def test_the_strict_vs_backfill_bench_reports_heads_and_no_late_admission(default_model_dir):
    from client.tools.backfill_bench import run_once
    from client.tools.workloads import make_workload
    items = make_workload("hol", 12, seed=1)
    strict = run_once(str(default_model_dir), False, items, kv_tokens=1024, block_size=16)
    backfill = run_once(str(default_model_dir), True, items, kv_tokens=1024, block_size=16)
    assert strict["backfilled"] == 0 and not strict["heads"]
    assert backfill["backfilled"] > 0 and backfill["heads"] and not backfill["late_heads"]
    assert strict["preemptions"] == backfill["preemptions"] == 0
