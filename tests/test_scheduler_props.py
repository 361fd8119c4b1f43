"""The scheduler driven without a model: random arrivals, lengths, EOS and aborts (hypothesis).

At every step: no block owned twice or leaked, the token budget and max_num_seqs hold, and under
guaranteed_no_evict the running requests' blocks-to-completion fit in the cache. At the end every
request finished and every block is free again."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from backend.core.step import Sampled
from backend.kv.block_manager import BlockManager
from backend.core.config import EngineConfig
from backend.core.sampling_params import SamplingParams
from backend.core.request import Request
from backend.sched.scheduler import Scheduler
from spec_driver import speculative_step

EOS = 0


def drive(policy: str, chunked: bool, seed: int, num_blocks: int, block_size: int, budget: int,
          max_seqs: int, n_requests: int, abort_rate: float, reuse: bool = False, speculate: int = 0):
    """speculate k > 0: the decode rows get up to k random drafts a step (spec_driver.py)."""
    rng = random.Random(seed)
    cfg = EngineConfig(model_path="unused", batch_scheduler_policy=policy, enable_chunked_context=chunked,
                       max_num_batched_tokens=budget, max_num_seqs=max_seqs, kv_block_size=block_size)
    sched = Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching=reuse), max_model_len=10_000)
    shared = [rng.randrange(1, 100) for _ in range(40)]  # a common prefix, so reuse has hits
    pending = []
    for i in range(n_requests):
        prompt = rng.randint(1, 60)
        max_tokens = rng.randint(1, 30)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        head = shared[:rng.randint(0, prompt)] if reuse else []
        tokens = head + [rng.randrange(1, 100) for _ in range(prompt - len(head))]
        req = Request(f"r{i}", tokens, params, (EOS,), arrival_time=0.0)
        try:
            sched.check_fits(prompt, max_tokens)
        except ValueError:
            continue  # too big for this cache even alone: refused at arrival
        pending.append(req)
    added, finished = [], set()
    for step in range(5000):
        while pending and rng.random() < 0.5:  # arrivals spread over the steps
            req = pending.pop()
            sched.add(req)
            added.append(req)
        if rng.random() < abort_rate and added:
            victim = rng.choice(added)
            if sched.abort(victim.request_id):
                finished.add(victim.request_id)
        if speculate:
            out = speculative_step(sched, rng, speculate, EOS, eos_rate=0.03, now=float(step))
            finished.update(s.request.request_id for s in out.seqs if s.request.status.finished)
            sched.check_integrity()
            if not pending and not sched.has_work:
                break
            continue
        out = sched.schedule(now=float(step))
        assert out.num_batched_tokens <= budget
        seen = [s.request.request_id for s in out.seqs]
        assert len(seen) == len(set(seen))
        for s in out.seqs:  # blocks cover every token computed this step
            assert sched.blocks.num_blocks_of(s.request.request_id) * block_size >= s.start + s.num_new_tokens
        sampled = {s.request.seq_id: Sampled(EOS if rng.random() < 0.03 else rng.randrange(1, 100))
                   for s in out.seqs if s.samples}
        for req in sched.postprocess(out, sampled, now=float(step)):
            finished.add(req.request_id)
        sched.check_integrity()
        if not pending and not sched.has_work:
            break
    assert not sched.has_work, "requests starved"
    assert finished == {r.request_id for r in added}
    assert sched.blocks.num_used_blocks == 0
    return sched


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), chunked=st.booleans(), num_blocks=st.integers(6, 40),
       block_size=st.sampled_from([1, 4, 16]), budget=st.integers(64, 200), max_seqs=st.integers(1, 12),
       n_requests=st.integers(1, 25), abort_rate=st.sampled_from([0.0, 0.05, 0.2]), reuse=st.booleans())
def test_no_evict_never_preempts(seed, chunked, num_blocks, block_size, budget, max_seqs, n_requests, abort_rate,
                                 reuse):
    sched = drive("guaranteed_no_evict", chunked, seed, num_blocks, block_size, budget, max_seqs,
                  n_requests, abort_rate, reuse)
    assert sched.num_preemptions == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), chunked=st.booleans(), num_blocks=st.integers(6, 40),
       block_size=st.sampled_from([1, 4, 16]), budget=st.integers(8, 200), max_seqs=st.integers(1, 12),
       n_requests=st.integers(1, 25), abort_rate=st.sampled_from([0.0, 0.05, 0.2]), reuse=st.booleans(),
       policy=st.sampled_from(["guaranteed_no_evict", "max_utilization"]), k=st.integers(1, 6))
def test_speculation_keeps_every_invariant(seed, chunked, num_blocks, block_size, budget, max_seqs, n_requests,
                                           abort_rate, reuse, policy, k):
    """With drafts on: the budget, the blocks of every position written, max_tokens, rejected
    drafts' blocks given back, no preemption under no-evict (and none caused by a draft under
    max_utilization), no leak at the end."""
    sched = drive(policy, chunked, seed, num_blocks, block_size, budget, max_seqs, n_requests, abort_rate, reuse,
                  speculate=k)
    if policy == "guaranteed_no_evict":
        assert sched.num_preemptions == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), chunked=st.booleans(), num_blocks=st.integers(6, 40),
       block_size=st.sampled_from([1, 4, 16]), budget=st.integers(64, 200), max_seqs=st.integers(1, 12),
       n_requests=st.integers(1, 25), abort_rate=st.sampled_from([0.0, 0.05, 0.2]), reuse=st.booleans())
def test_max_utilization_stays_consistent(seed, chunked, num_blocks, block_size, budget, max_seqs,
                                          n_requests, abort_rate, reuse):
    drive("max_utilization", chunked, seed, num_blocks, block_size, budget, max_seqs, n_requests, abort_rate,
          reuse)


def test_max_utilization_preempts_under_pressure():
    sched = drive("max_utilization", True, seed=1, num_blocks=12, block_size=4, budget=128, max_seqs=12,
                  n_requests=25, abort_rate=0.0)
    assert sched.num_preemptions > 0


def test_no_evict_admits_in_order_without_skipping():
    cfg = EngineConfig(model_path="unused", max_num_batched_tokens=1000)
    sched = Scheduler(cfg, BlockManager(10, 4), max_model_len=1000)
    big = Request("big", [1] * 20, SamplingParams(max_tokens=16, temperature=0))  # 9 blocks
    small = Request("small", [1] * 2, SamplingParams(max_tokens=2, temperature=0))  # 1 block
    later = Request("later", [1] * 4, SamplingParams(max_tokens=4, temperature=0))  # 2 blocks
    for r in (big, small, later):
        sched.add(r)
    out = sched.schedule(0.0)
    assert [s.request.request_id for s in out.seqs] == ["big", "small"]  # 9 + 1 = 10 blocks reserved
    assert [r.request_id for r in sched.waiting] == ["later"]


def test_request_that_cannot_fit_alone_is_refused_with_numbers():
    cfg = EngineConfig(model_path="unused")
    sched = Scheduler(cfg, BlockManager(4, 4), max_model_len=1000)
    try:
        sched.add(Request("x", [1] * 10, SamplingParams(max_tokens=10)))
    except ValueError as e:
        assert "KV cache" in str(e) and "16 tokens" in str(e) and "20" in str(e)
    else:
        raise AssertionError("a request larger than the cache was accepted")
