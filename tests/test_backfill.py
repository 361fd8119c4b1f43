"""Backfilled admission under guaranteed_no_evict, request priority and prefix-aware reservation.

The head-of-line case from TensorRT-LLM #2866, reproduced on the scheduler: a head that does not fit
no longer blocks small requests that cannot delay it; a property test over random workloads checks
that nothing is preempted, no block leaks or is owned twice, and no head starts later than its
reservation."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.kv.block_manager import BlockManager
from backend.core.config import EngineConfig
from backend.core.step import Sampled
from backend.core.sampling_params import SamplingParams
from backend.core.request import Request, RequestStatus
from backend.sched.scheduler import Scheduler
from spec_driver import speculative_step

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


def step(sched, token=7, eos_rate=0.0, rng=None, check=True):
    out = sched.schedule(0.0)
    sampled = {s.request.seq_id: Sampled(EOS if rng and rng.random() < eos_rate else token)
               for s in out.seqs if s.samples}
    sched.postprocess(out, sampled, 0.0)
    if check:
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


# Two shapes of workload make the worst case tight, so that a rule bent by one token shows:
# one-token prompts (the finish bounds are exact: every step samples), and long prompts on a small
# budget (running prefills take the whole budget on the head's reserved step unless a token is held).
SHAPES = {"one-token prompts": dict(prompt=(1, 1), max_tokens=(1, 24), blocks=(4, 24), block_sizes=(1, 2, 4),
                                    budget=(9, 64), max_seqs=(2, 8), arrive=0.5),
          "long prompts, small budget": dict(prompt=(1, 200), max_tokens=(1, 80), blocks=(8, 48),
                                             block_sizes=(1, 4, 16), budget=(9, 20), max_seqs=(1, 8), arrive=0.6)}


def seeded_run(seed: int, shape: dict, priorities: bool = False, speculate: int = 0) -> tuple[list, list]:
    """One random run. Returns (late, broken): the heads that started after the reservation they
    were promised (reset when a more urgent request arrived while they waited), and those that
    started after the first reservation they were ever given. speculate k > 0: decode rows get up
    to k random drafts a step from the budget left (tests/spec_driver.py)."""
    rng = random.Random(seed)
    max_seqs = rng.randint(*shape["max_seqs"])
    sched = make(rng.randint(*shape["blocks"]), rng.choice(shape["block_sizes"]),
                 max(rng.randint(*shape["budget"]), max_seqs + 1), max_seqs)
    pending = []
    for i in range(rng.randint(5, 30)):
        r = req(f"r{i}", rng.randint(*shape["prompt"]), rng.randint(*shape["max_tokens"]),
                priority=rng.randint(-2, 2) if priorities else 0)
        try:
            sched.check_fits(r.num_prompt_tokens, r.params.max_tokens)
        except ValueError:
            continue
        pending.append(r)
    promised: dict[str, int] = {}
    first: dict[str, int] = {}
    late, broken = [], []
    while pending or sched.has_work:
        while pending and rng.random() < shape["arrive"]:
            new = pending.pop(0)
            for w in sched.waiting:  # the rule's exception: a more urgent arrival voids the promise
                if new.priority < w.priority:
                    promised.pop(w.seq_id, None)
            sched.add(new)
        waiting = {r.seq_id for r in sched.waiting}
        out = (speculative_step(sched, rng, speculate, EOS, token_range=(7, 8)) if speculate
               else step(sched, check=False))  # the property test checks integrity at every step
        for s in out.seqs:
            sid = s.request.seq_id
            if sid in waiting and sched.steps > promised.get(sid, sched.steps):
                late.append((sid, promised[sid], sched.steps))
            if sid in waiting and sched.steps > first.get(sid, sched.steps):
                broken.append((sid, first[sid], sched.steps))
        if sched.reservation is not None:
            sid, at = sched.reservation
            promised[sid] = min(promised.get(sid, at), at)
            first.setdefault(sid, at)
        assert sched.steps < 20_000, "requests starved"
    sched.check_integrity()
    assert sched.num_preemptions == 0 and sched.blocks.num_used_blocks == 0
    return late, broken


@pytest.mark.parametrize("shape", SHAPES)
def test_speculation_keeps_every_reservation(shape):
    """Drafts take only the budget and blocks the formed batch left: with them on, no head starts
    past its reservation either (and nothing is preempted, no block leaks)."""
    runs = [seeded_run(seed, SHAPES[shape], speculate=1 + seed % 5) for seed in range(150)]
    late = [(seed, late) for seed, (late, _) in enumerate(runs) if late]
    assert not late, f"heads started past their reservation: {late[:3]}"


@pytest.mark.parametrize("shape", SHAPES)
def test_no_head_starts_past_its_reservation_in_300_seeded_runs(shape):
    """Equal priorities: every reservation is kept (the promise in docs/design.md)."""
    runs = [seeded_run(seed, SHAPES[shape]) for seed in range(300)]
    late = [(seed, late) for seed, (late, _) in enumerate(runs) if late]
    assert not late, f"heads started past their reservation: {late[:3]}"
    assert sum(bool(b) for _, b in runs) == 0


def test_a_more_urgent_arrival_voids_a_reservation_and_only_that_does():
    """Priorities, both ways: a request more urgent than the head runs first, so the head may start
    after the reservation it had (it happens: the rule is not vacuous); but a head that saw no more
    urgent arrival while it waited, or the reservation it got after one, is always kept."""
    broken = 0
    for shape in SHAPES.values():
        for seed in range(300):
            late, was_broken = seeded_run(seed, shape, priorities=True)
            assert not late, f"seed {seed}: heads started past their reservation: {late[:3]}"
            broken += bool(was_broken)
    assert broken > 20, "more urgent arrivals should delay some heads past their first reservation"


def test_the_reservation_is_computed_again_after_a_more_urgent_arrival():
    """A (running) holds 4 of 10 blocks until step 9; the head needs 9 and is reserved for step 10.
    An urgent request that fits now starts at once on blocks the head was promised: the head's
    reservation is dropped and computed again (later), and the head keeps the new one."""
    sched = make(num_blocks=10, block_size=4)
    sched.add(req("A", 4, 9))
    step(sched)
    sched.add(req("head", 4, 33))
    step(sched)
    assert sched.reservation[0] == "head"
    first = sched.reservation[1]
    sched.add(req("urgent", 4, 12, priority=-1))
    assert sched.reservation is None  # void at once: the urgent request runs first
    out = step(sched)
    assert [s.request.request_id for s in out.seqs if s.start == 0] == ["urgent"]
    assert sched.reservation[0] == "head" and sched.reservation[1] > first
    again = sched.reservation[1]
    while "head" in {r.request_id for r in sched.waiting}:
        step(sched)
    assert first < sched.steps <= again


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
    from backend.sched.backfill import Window, finish_bounds, own_work
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


@pytest.mark.slow
def test_the_strict_vs_backfill_bench_reports_heads_and_no_late_admission(default_model_dir):
    from client.tools.benchmarks.backfill import run_once
    from client.tools.benchmarks.workloads import make_workload
    items = make_workload("hol", 12, seed=1)
    strict = run_once(str(default_model_dir), False, items, kv_tokens=1024, block_size=16)
    backfill = run_once(str(default_model_dir), True, items, kv_tokens=1024, block_size=16)
    assert strict["backfilled"] == 0 and not strict["heads"]
    assert backfill["backfilled"] > 0 and backfill["heads"] and not backfill["late_heads"]
    assert strict["preemptions"] == backfill["preemptions"] == 0


def overloaded(n_waiting: int, reuse: bool = False):
    """32 running requests reserving the whole cache, and n_waiting that cannot start."""
    sched = make(num_blocks=256, block_size=16, budget=2048, max_seqs=64, reuse=reuse)
    for i in range(32):
        sched.add(req(f"run{i}", 64, 65, first=1 + 100 * i))  # 128 tokens: 8 blocks each
    while len(sched.running) < 32 or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        step(sched, check=False)
    for i in range(n_waiting):
        sched.add(req(f"wait{i}", 40, 60, first=5000 + 50 * i))  # 7 blocks: does not fit
    return sched


def test_an_admission_pass_costs_o1_per_waiting_request():
    """Under overload every waiting request is tried at every step (backfill). Trying one reads no
    running request's blocks: the reservation is a tally kept as requests start and end, so the
    block tables read in a pass are the same with 10 or 1,000 waiting (before: one pass over every
    running request's blocks per waiting request, ~200 ms a step with 1,000 waiting)."""
    reads = {}
    for n_waiting in (10, 1000):
        for reuse in (False, True):
            sched = overloaded(n_waiting, reuse)
            calls = [0]
            table = sched.blocks.block_table

            def counted(seq_id, table=table, calls=calls):
                calls[0] += 1
                return table(seq_id)

            sched.blocks.block_table = counted
            for _ in range(3):
                out = step(sched, check=False)
                assert not [s for s in out.seqs if s.request.request_id.startswith("wait")]
            assert len(sched.waiting) == n_waiting and sched.reservation is not None
            reads[n_waiting, reuse] = calls[0]
            sched.check_integrity()
    assert reads[10, False] == reads[1000, False] and reads[10, True] == reads[1000, True], reads


def test_stats_reads_the_reserved_tally_and_it_matches_the_block_tables():
    sched = overloaded(20)
    policy = sched.policy
    assert policy.reserved_blocks() == policy.reserved_by(sched.running) == 256
    sched.abort("run3")
    assert policy.reserved_blocks() == policy.reserved_by(sched.running) == 256 - 8
    while sched.has_work:
        step(sched, check=False)
        assert policy.reserved_blocks() == policy.reserved_by(sched.holders())
    assert policy.reserved_blocks() == 0
