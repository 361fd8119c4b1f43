"""The queue's expected drain time (backend/sched/drain.py) against a synthetic workload: the real
scheduler runs with no model, a synthetic device prices each step (fixed step times: a base, a
price per decode row and per prompt token), a fake clock adds them up, and each waiting request's
predicted wait (and a new arrival's predicted time to first token) is compared with when it really
started. Then the engine's use of it, on the tiny model: a full queue and a time-to-first-token
target that cannot be met are refused at arrival with the seconds to retry after, one that can be
met is served, the rejection counter moves by reason, and queue info reports the expected wait."""
import time

import pytest

from backend.core.errors import QueueFullError, TTFTTargetError, retry_after_of
from backend.sched.drain import MAX_SIMULATED, REFRESH_SECONDS, DrainEstimator, EwmaCost, Limits, Prices, Work, simulate
from backend.sched.step_cost import batch_shape
from test_backfill import make, req, step

# The estimate is a replay of the same policy with the device's mean prices: within this share of
# the real wait, plus one step (a request starts at a step boundary).
TOLERANCE = 0.10


class Device:
    """Fixed step times: base + per decode row + per prompt token."""

    def __init__(self, base=0.020, row=0.001, token=0.0005):
        self.base, self.row, self.token = base, row, token

    def seconds(self, batch) -> float:
        rows, tokens, _, _ = batch_shape(batch)
        return self.base + self.row * rows + self.token * tokens


def estimator(sched) -> DrainEstimator:
    cfg = sched.config
    return DrainEstimator(Limits(cfg.max_num_seqs, cfg.max_num_batched_tokens, sched.blocks.num_blocks),
                          cfg.batch_scheduler_policy == "guaranteed_no_evict", sched.blocks.blocks_for)


def run(sched, device, drain, clock=0.0, until=None):
    """Step to the end (or until `until()`); returns ({seq_id: start time}, {seq_id: first token time}, clock)."""
    started, first = {}, {}
    while sched.has_work and not (until and until()):
        out = step(sched, check=False)
        seconds = device.seconds(out)
        rows, tokens, pairs, kv = batch_shape(out)
        sched.pacer.observe(rows, tokens, pairs, seconds, kv)
        drain.observe(rows, tokens, seconds)
        for s in out.seqs:
            started.setdefault(s.request.seq_id, clock)
            if s.request.output_token_ids:  # (after postprocess: it sampled this step or before)
                first.setdefault(s.request.seq_id, clock + seconds)
        clock += seconds
    return started, first, clock


def workload(sched, waiting=12):
    """4 running (prompts done, decoding) and `waiting` behind them, of mixed sizes."""
    for i in range(4):
        sched.add(req(f"run{i}", 8 + 4 * i, 20 + 10 * i))
    for i in range(waiting):
        sched.add(req(f"w{i}", 10 + (i * 37) % 60, 10 + (i * 23) % 40, first=100 + i))


@pytest.mark.parametrize("pacing", [-1.0, 0.0])
def test_the_expected_waits_match_a_synthetic_workload(pacing):
    """Strict order (no backfill: the replay starts requests in queue order; with backfill a small
    request may start earlier than it says, an upper estimate)."""
    sched = make(num_blocks=64, block_size=4, budget=64, max_seqs=4, backfill=False)
    sched.config.inter_token_target_ms = sched.pacer.target_ms = pacing
    device, drain = Device(), estimator(sched)
    workload(sched)
    _, _, clock = run(sched, device, drain, until=lambda: sched.steps >= 6)  # prompt and decode steps seen
    drain.update(sched, now=clock)
    predicted = {r.seq_id: drain.wait_of(r.seq_id, i) for i, r in enumerate(sched.waiting)}
    late = req("late", 30, 16, first=900)
    ttft = drain.expected_ttft(late.num_prompt_tokens, late.params.max_tokens)
    sched.add(late)
    started, first, _ = run(sched, device, drain, clock)
    step_time = device.base + 4 * device.row + device.token * 64
    assert len(predicted) == 12
    for seq_id, wait in predicted.items():
        real = started[seq_id] - clock
        assert abs(wait - real) <= TOLERANCE * real + step_time, (seq_id, wait, real)
    real = first["late"] - clock
    assert abs(ttft - real) <= TOLERANCE * real + step_time, (ttft, real)
    assert drain.drain_seconds() == pytest.approx(max(predicted.values()))


def test_the_snapshot_is_replayed_when_a_count_changes_or_the_refresh_interval_has_passed():
    """Between, only decode steps ran: the last snapshot stands (a replay every step was ~10% of a
    batch-1 step's host time), and a request arriving reads a figure at most REFRESH_SECONDS older."""
    sched = make(num_blocks=64, block_size=4, budget=64, max_seqs=4, backfill=False)
    device, drain = Device(), estimator(sched)
    workload(sched)
    _, _, clock = run(sched, device, drain, until=lambda: sched.steps >= 6)
    drain.update(sched, now=clock)
    first = drain.snapshot
    assert first.prices is not None and first.waits
    drain.update(sched, now=clock + 0.9 * REFRESH_SECONDS)  # the same requests, within the interval
    assert drain.snapshot is first
    drain.update(sched, now=clock + 1.01 * REFRESH_SECONDS)  # the interval has passed: replayed
    second = drain.snapshot
    assert second is not first and second.waits == pytest.approx(first.waits)
    sched.add(req("late", 30, 16, first=900))  # one more waiting: replayed at once
    drain.update(sched, now=clock + 1.02 * REFRESH_SECONDS)
    assert drain.snapshot is not second and drain.drain_seconds() > second.drain_seconds
    third = drain.snapshot
    counts = (len(sched.running), len(sched.waiting))
    while (len(sched.running), len(sched.waiting)) == counts:  # until one ends and the next starts
        step(sched, check=False)
    drain.update(sched, now=clock + 1.03 * REFRESH_SECONDS)
    assert drain.snapshot is not third


def test_nothing_is_known_before_a_step_has_run():
    sched = make(num_blocks=64)
    drain = estimator(sched)
    workload(sched)
    drain.update(sched)
    assert drain.drain_seconds() == 0.0 and drain.expected_ttft(100, 100) == 0.0
    assert drain.wait_of("w0-0", 0) is None


def test_a_long_queue_is_extrapolated_past_the_replayed_requests():
    prices = Prices(_Flat(0.01), 4)
    limits = Limits(4, 64, 10_000)
    waiting = [Work(8, 10, 5, key=f"w{i}") for i in range(MAX_SIMULATED)]
    snap = simulate([], waiting, limits, prices, beyond=100)
    assert snap.drain_seconds == pytest.approx(max(snap.waits.values()) + 100 * snap.spacing)
    assert snap.spacing > 0


class _Flat:
    def __init__(self, step):
        self.step = step

    def decode_seconds(self, rows):
        return self.step if rows else 0.0

    def prompt_seconds(self, start, n):
        return 0.0


def test_the_ewma_follows_the_last_steps():
    cost = EwmaCost()
    for _ in range(50):
        cost.observe(4, 0, 0.02)
        cost.observe(4, 100, 0.05)
    assert cost.decode_seconds(4) == pytest.approx(0.02) and cost.prompt_seconds(0, 10) == pytest.approx(0.005)
    cost.observe(4, 0, float("nan"))
    assert cost.decode_seconds(1) == pytest.approx(0.02)


def test_the_retry_after_figure_is_in_the_message_and_read_back():
    err = QueueFullError("queue full: 2 requests are waiting (max_queue_size)", 2.2)
    assert err.retry_after == 3 and retry_after_of(str(err)) == 3 and str(err).endswith("retry after 3 s")
    assert QueueFullError("queue full", 0.0).retry_after == 1  # never 0: that would say "now"
    assert retry_after_of("queue full: retry later") is None
    assert TTFTTargetError("x", 5).reason == "ttft_target" and QueueFullError("x").reason == "queue_full"


# -- the engine's use of it (the tiny model) ---------------------------------------------------------

@pytest.fixture(scope="module")
def engine(default_model_dir):
    from backend import LLM
    return LLM(str(default_model_dir), max_num_seqs=1, max_queue_size=3).engine


def greedy(max_tokens, **kw):
    from backend import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def drain_all(engine):
    while engine.has_work():
        engine.step()


def test_overload_is_told_at_arrival_with_the_seconds_to_retry_after(engine):
    engine.add_request("a", list(range(3, 40)), greedy(40))
    for _ in range(3):
        engine.step()  # "a" decodes: the engine has priced its steps
    before = engine.stats()
    engine.add_request("b", list(range(3, 40)), greedy(40), queue_info=True)
    engine.add_request("c", list(range(3, 40)), greedy(40))
    outs = engine.step()
    waits = [o.queue.expected_wait_seconds for o in outs if o.request_id == "b" and o.queue is not None]
    assert waits and waits[-1] > 0, "queue info reports the expected wait while it waits"
    # a target the queue cannot meet (two requests of 40 tokens ahead): refused, with a figure
    with pytest.raises(TTFTTargetError, match=r"time-to-first-token target.*retry after \d+ s") as refused:
        engine.add_request("d", list(range(3, 40)), greedy(8, ttft_target_ms=1))
    assert refused.value.retry_after >= 1
    engine.add_request("e", list(range(3, 40)), greedy(8, ttft_target_ms=600_000))  # one it can meet: queued
    with pytest.raises(QueueFullError, match=r"max_queue_size.*retry after \d+ s") as full:
        engine.add_request("f", list(range(3, 40)), greedy(8))
    assert not isinstance(full.value, TTFTTargetError)
    drained = engine.drain.drain_seconds()
    assert full.value.retry_after == max(1, int(-(-drained // 1))) or abs(full.value.retry_after - drained) < 2
    after = engine.stats()
    assert after["num_rejected_ttft_target"] - before["num_rejected_ttft_target"] == 1
    assert after["num_rejected_queue_full"] - before["num_rejected_queue_full"] == 1
    finished = set()
    while engine.has_work():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert {"a", "b", "c", "e"} <= finished and "d" not in finished


def test_the_config_default_target_applies_and_a_request_may_lift_it(default_model_dir):
    from backend import LLM
    engine = LLM(str(default_model_dir), max_num_seqs=1, ttft_target_ms=1).engine
    engine.add_request("a", list(range(3, 40)), greedy(30))
    for _ in range(3):
        engine.step()
    with pytest.raises(TTFTTargetError, match="ttft_target_ms"):
        engine.add_request("b", list(range(3, 40)), greedy(8))
    engine.add_request("c", list(range(3, 40)), greedy(8, ttft_target_ms=0))  # 0: no target
    t0 = time.monotonic()
    drain_all(engine)
    assert time.monotonic() - t0 < 120
