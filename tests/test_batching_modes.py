"""The batching modes (`batching_mode`): none runs one request at a time; static waits to fill or
for the delay; dynamic buckets by prompt length within the padding threshold; static and dynamic
batches are padded for real (padding rows) and run to their longest member; padding rows never
write the KV cache and never change what the real rows compute."""
from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from backend import LLM, EngineConfig, SamplingParams
from backend.core.step import Sampled
from backend.kv.block_manager import BlockManager
from backend.engine.async_engine import AsyncEngine
from backend.core.request import Request
from backend.sched.factory import make_scheduler
from backend.core.step import Row, StepPlan

EOS = 0


def make_sched(mode="inflight", *, num_blocks=200, block_size=4, budget=512, max_seqs=8,
               policy="guaranteed_no_evict", **kw):
    cfg = EngineConfig(model_path="unused", batching_mode=mode, kv_block_size=block_size,
                       max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                       batch_scheduler_policy=policy, **kw)
    return make_scheduler(cfg, BlockManager(num_blocks, block_size), max_model_len=10_000)


def req(rid, prompt_len, max_tokens, t=0.0):
    return Request(rid, [5] * prompt_len, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   (EOS,), arrival_time=t)


def step(sched, now):
    """One scheduler step with a fake model that never samples EOS; returns the output."""
    out = sched.schedule(now)
    sampled = {s.request.seq_id: Sampled(7) for s in out.seqs if s.samples}
    sched.postprocess(out, sampled, now)
    sched.check_integrity()
    return out


def run_out(sched, now=0.0, max_steps=10_000):
    outs = []
    for _ in range(max_steps):
        if not sched.has_work:
            return outs
        outs.append(step(sched, now))
        sched.pool.pop_released()
    raise AssertionError("did not finish")


# -- none ------------------------------------------------------------------------------------
def test_none_runs_one_request_at_a_time():
    sched = make_sched("none")
    for i in range(4):
        sched.add(req(f"r{i}", 5 + i, 3))
    order = []
    while sched.has_work:
        out = step(sched, 0.0)
        assert len(sched.running) <= 1
        ids = {s.request.request_id for s in out.seqs}
        assert len(ids) <= 1 and not out.padding
        order.extend(i for i in ids if not order or order[-1] != i)
    assert order == ["r0", "r1", "r2", "r3"]


# -- static ----------------------------------------------------------------------------------
def test_static_waits_to_fill_then_starts_the_batch_whole():
    sched = make_sched("static", executor_static_batch_size=4, max_queue_delay_microseconds=1_000_000)
    for i in range(3):
        sched.add(req(f"r{i}", 10, 3, t=0.0))
    assert sched.schedule(0.5).is_empty  # 3 of 4, and the delay has not passed
    sched.add(req("r3", 10, 3, t=0.5))
    out = sched.schedule(0.5)
    assert {s.request.request_id for s in out.seqs} == {"r0", "r1", "r2", "r3"}


def test_static_starts_a_partial_batch_after_the_delay():
    sched = make_sched("static", executor_static_batch_size=4, max_queue_delay_microseconds=1_000_000)
    sched.add(req("a", 10, 3, t=0.0))
    sched.add(req("b", 10, 3, t=0.2))
    assert sched.schedule(0.99).is_empty
    assert sched.gate.next_deadline(sched.waiting) == pytest.approx(1.0)
    out = sched.schedule(1.0)
    assert {s.request.request_id for s in out.seqs} == {"a", "b"}


def test_static_batch_is_not_cut_by_the_token_budget():
    """A batch of 4 prompts of 40 with a budget of 64 tokens starts whole; prefill is chunked."""
    sched = make_sched("static", executor_static_batch_size=4, budget=64, max_queue_delay_microseconds=0)
    for i in range(6):
        sched.add(req(f"r{i}", 40, 2))
    step(sched, 0.0)
    assert [r.request_id for r in sched.running] == ["r0", "r1", "r2", "r3"]
    assert len(sched.waiting) == 2


def test_static_pads_prompts_and_runs_to_the_longest_member():
    sched = make_sched("static", executor_static_batch_size=3, max_queue_delay_microseconds=0)
    members = [req("short", 4, 2), req("mid", 10, 5), req("long", 16, 9)]
    for r in members:
        sched.add(r)
    sched.add(req("next", 8, 2))  # must wait for the whole batch to end
    prompt_pad = decode_pad = 0
    released_at = {}
    for n in range(100):
        out = step(sched, 0.0)
        for s in out.padding:
            assert s.padding and not s.samples
            if s.request.status.finished:
                decode_pad += s.num_new_tokens
            else:
                prompt_pad += s.num_new_tokens
        assert all(s.request.request_id != "next" for s in out.seqs) or not sched.pool.lingering
        for r in sched.pool.pop_released():
            released_at[r.request_id] = n
        if "next" in {s.request.request_id for s in out.seqs}:
            break
    # prompts padded to the longest (16): 12 + 6 padding tokens
    assert prompt_pad == (16 - 4) + (16 - 10)
    # after finishing, short (2 tokens) and mid (5) decode on until long's 9th token
    assert decode_pad == (9 - 2) + (9 - 5)
    # all three answer together, when the longest finishes; only then does the next batch start
    assert released_at["short"] == released_at["mid"] == released_at["long"]
    assert sched.blocks.num_blocks_of("short") == 0


def test_finished_members_keep_their_blocks_until_the_batch_ends():
    sched = make_sched("static", executor_static_batch_size=2, max_queue_delay_microseconds=0)
    sched.add(req("a", 8, 1))
    sched.add(req("b", 8, 6))
    step(sched, 0.0)  # prefill: a samples its only token and finishes
    assert [r.request_id for r in sched.pool.lingering] == ["a"]
    assert sched.blocks.num_blocks_of("a") > 0
    assert not sched.pool.pop_released()
    run_out(sched)
    assert sched.blocks.num_used_blocks == 0


def test_aborting_the_last_running_member_ends_the_batch():
    sched = make_sched("static", executor_static_batch_size=2, max_queue_delay_microseconds=0)
    sched.add(req("a", 8, 1))
    sched.add(req("b", 8, 50))
    step(sched, 0.0)
    sched.abort("b")
    assert [r.request_id for r in sched.pool.pop_released()] == ["a"]
    assert sched.blocks.num_used_blocks == 0 and not sched.has_work


# -- dynamic ---------------------------------------------------------------------------------
def test_dynamic_buckets_by_length_within_the_threshold():
    sched = make_sched("dynamic", max_seqs=8, dynamic_padding_threshold=1.1, max_queue_delay_microseconds=0)
    for i, n in enumerate([100, 40, 108, 95, 111, 10, 104, 200]):
        sched.add(req(f"r{i}", n, 2))
    out = step(sched, 0.0)
    lens = sorted(r.num_prompt_tokens for r in sched.running)
    assert lens[-1] <= 1.1 * lens[0]
    assert lens == [95, 100, 104]  # nearest lengths first, while max <= 1.1 x min
    assert sum(s.num_new_tokens for s in out.padding) == (104 - 95) + (104 - 100)


def test_dynamic_waits_for_a_full_batch_or_the_delay():
    sched = make_sched("dynamic", max_seqs=4, max_queue_delay_microseconds=500_000)
    sched.add(req("a", 10, 2, t=0.0))
    assert sched.schedule(0.1).is_empty
    assert not sched.schedule(0.5).is_empty


# -- properties under random arrivals and aborts ---------------------------------------------
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), mode=st.sampled_from(["static", "dynamic", "none"]),
       policy=st.sampled_from(["guaranteed_no_evict", "max_utilization"]),
       num_blocks=st.integers(8, 40), budget=st.integers(32, 160), max_seqs=st.integers(1, 8),
       abort_rate=st.sampled_from([0.0, 0.1]))
def test_request_level_batches_stay_consistent(seed, mode, policy, num_blocks, budget, max_seqs, abort_rate):
    rng = random.Random(seed)
    sched = make_sched(mode, num_blocks=num_blocks, block_size=4, budget=budget, max_seqs=max_seqs,
                       policy=policy, max_queue_delay_microseconds=2, dynamic_padding_threshold=1.5)
    pending = []
    for i in range(rng.randint(1, 20)):
        r = req(f"r{i}", rng.randint(1, 40), rng.randint(1, 20))
        try:
            sched.check_fits(r.num_prompt_tokens, r.params.max_tokens)
        except ValueError:
            continue
        pending.append(r)
    added, answered = [], set()
    for n in range(5000):
        while pending and rng.random() < 0.5:
            r = pending.pop()
            r.arrival_time = float(n)
            sched.add(r)
            added.append(r)
        if added and rng.random() < abort_rate:
            victim = rng.choice(added)
            if sched.abort(victim.request_id):
                answered.add(victim.request_id)
        out = sched.schedule(float(n))
        assert out.num_batched_tokens <= budget
        assert sched.num_running <= max_seqs
        sampled = {s.request.seq_id: Sampled(EOS if rng.random() < 0.05 else 7) for s in out.seqs if s.samples}
        finished = sched.postprocess(out, sampled, float(n))
        if not sched.gate.pads:
            answered.update(r.request_id for r in finished)
        if sched.gate.pads:
            answered.update(r.request_id for r in sched.pool.pop_released())
        sched.check_integrity()
        if not pending and not sched.has_work:
            break
    assert not sched.has_work, "requests starved"
    assert answered == {r.request_id for r in added}
    assert sched.blocks.num_used_blocks == 0


# -- with the model ----------------------------------------------------------------------------
PROMPTS = [[3 + (7 * i + j) % 1900 for j in range(n)] for i, n in enumerate([5, 23, 9, 40, 17, 31])]
PARAMS = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in [3, 12, 6, 2, 9, 5]]


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return [o.token_ids for o in LLM(str(default_model_dir)).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("mode", ["none", "static", "dynamic"])
def test_every_mode_gives_the_same_greedy_tokens(default_model_dir, reference, mode):
    llm = LLM(str(default_model_dir), batching_mode=mode, max_num_seqs=4, max_num_batched_tokens=48,
              dynamic_padding_threshold=3.0, max_queue_delay_microseconds=0)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == reference
    assert llm.stats()["kv_blocks_used"] == 0


def test_padding_rows_never_write_the_cache(default_model_dir):
    llm = LLM(str(default_model_dir), batching_mode="static", max_queue_delay_microseconds=0)
    engine = llm.engine
    r = engine.add_request("ctx", PROMPTS[3], SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # prefill: its context is in the cache
    before = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    plan = StepPlan(padding=[Row(r.seq_id, r.num_computed_tokens, 1, samples=False, padding=True),
                             Row(r.seq_id, 10, 25, samples=False, padding=True)])
    from backend.worker.step_inputs import build_step
    slots = build_step(plan, engine.runner.batch, 0).slot_mapping
    assert (slots == -1).all()
    assert engine.runner.execute(plan).sampled == {}
    for (k0, v0), (k1, v1) in zip(before, engine.runner.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_static_server_answers_each_member_once_when_the_batch_ends(default_model_dir, reference):
    eng = AsyncEngine(EngineConfig(model_path=str(default_model_dir), batching_mode="static",
                                   executor_static_batch_size=len(PROMPTS), max_queue_delay_microseconds=10**7))
    got, done = {}, threading.Event()

    def sink(o):
        got.setdefault(o.request_id, []).append(o)
        if sum(x[-1].finished for x in got.values()) == len(PROMPTS):
            done.set()
    try:
        for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
            eng.add_request(f"r{i}", p, sp, sink)
        assert done.wait(60)
        for i in range(len(PROMPTS)):
            outs = got[f"r{i}"]
            assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
            assert outs[0].new_token_ids == outs[0].token_ids == reference[i]
        assert eng.stats()["kv_blocks_used"] == 0
    finally:
        eng.shutdown()
