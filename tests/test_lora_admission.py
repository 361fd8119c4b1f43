"""LoRA slots in admission, driven without a model (backend/sched/lora_slots.py): never more than
max_loras adapters among the running requests, a request of a further adapter waits in the queue
(never an error) and starts once a slot frees, the running adapters' later requests queue behind
it rather than starve it, and base-model requests are never held back. Also with hypothesis, over
both policies, padded batches, prefix caching and aborts: every request finishes, no block leaks,
the slot bound holds at every step."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from backend.kv.block_manager import BlockManager
from backend.core.config import EngineConfig
from backend.core.lora import cache_salt
from backend.core.sampling_params import SamplingParams
from backend.core.request import Request
from backend.sched.factory import make_scheduler
from backend.sched.lora_slots import adapters_of
from backend.core.step import Sampled

EOS = 0


def request(rid, adapter, prompt=5, max_tokens=4, priority=0):
    req = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                  (EOS,), arrival_time=0.0, priority=priority)
    if adapter:
        req.lora_name, req.cache_salt = adapter, cache_salt(adapter, 1)
    return req


def scheduler(max_loras, **overrides):
    cfg = EngineConfig(model_path="unused", enable_lora=True, max_loras=max_loras, kv_block_size=4,
                       max_num_seqs=overrides.pop("max_num_seqs", 8), **overrides)
    return make_scheduler(cfg, BlockManager(256, 4, enable_prefix_caching=cfg.enable_kv_cache_reuse), 10_000)


def step(sched, t, finish=()):
    """One step; requests whose id is in `finish` sample EOS (and end)."""
    out = sched.schedule(now=float(t))
    sampled = {s.request.seq_id: Sampled(EOS if s.request.request_id in finish else 7) for s in out.seqs if s.samples}
    sched.postprocess(out, sampled, now=float(t))
    sched.deliver([])  # padded batches release their members here
    return out


def running(sched):
    return sorted(r.request_id for r in sched.running)


def test_a_further_adapter_waits_for_a_slot_then_starts():
    sched = scheduler(max_loras=2)
    for rid, adapter in [("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None), ("a2", "a")]:
        sched.add(request(rid, adapter, max_tokens=20))
    step(sched, 0)
    # c1 waits (no slot); a2's adapter runs, but it is behind c1 and waits too; the base request does not
    assert running(sched) == ["a1", "b1", "base"]
    assert [r.request_id for r in sched.waiting] == ["c1", "a2"]
    step(sched, 1, finish={"a1"})  # a's last request ends: its slot frees
    step(sched, 2)
    assert running(sched) == ["b1", "base", "c1"]
    assert adapters_of(sched.running) == 2
    step(sched, 3, finish={"b1"})
    step(sched, 4)
    assert running(sched) == ["a2", "base", "c1"]


def test_a_more_urgent_request_of_a_running_adapter_goes_first():
    sched = scheduler(max_loras=1)
    sched.add(request("a1", "a", max_tokens=20))
    step(sched, 0)
    sched.add(request("b1", "b"))
    sched.add(request("a2", "a", priority=-1))  # more urgent than b1: tried first, its adapter runs
    step(sched, 1)
    assert running(sched) == ["a1", "a2"]
    assert [r.request_id for r in sched.waiting] == ["b1"]


def test_padded_batches_keep_to_the_slots_too():
    sched = scheduler(max_loras=1, batching_mode="static", executor_static_batch_size=3, max_num_seqs=3)
    for rid, adapter in [("a1", "a"), ("a2", "a"), ("b1", "b")]:
        sched.add(request(rid, adapter))
    for t in range(40):
        step(sched, t)
        assert adapters_of(sched.running) <= 1
        if not sched.has_work:
            break
    assert not sched.has_work


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), max_loras=st.integers(1, 3), adapters=st.integers(1, 5),
       policy=st.sampled_from(["guaranteed_no_evict", "max_utilization"]), reuse=st.booleans(),
       mode=st.sampled_from(["inflight", "inflight", "dynamic"]), abort_rate=st.sampled_from([0.0, 0.1]))
def test_the_slot_bound_holds_and_every_request_finishes(seed, max_loras, adapters, policy, reuse, mode, abort_rate):
    rng = random.Random(seed)
    sched = scheduler(max_loras, batch_scheduler_policy=policy, enable_kv_cache_reuse=reuse, batching_mode=mode,
                      max_num_seqs=6, max_num_batched_tokens=64)
    pending = []
    for i in range(30):
        adapter = rng.choice([None] + [f"L{k}" for k in range(adapters)])
        req = request(f"r{i}", adapter, prompt=rng.randint(1, 30), max_tokens=rng.randint(1, 12),
                      priority=rng.choice([0, 0, 1]))
        req.prompt_token_ids[:8] = [9] * min(8, len(req.prompt_token_ids))  # shared heads for the cache
        pending.append(req)
    added, done = [], set()
    for t in range(3000):
        while pending and rng.random() < 0.4:
            added.append(pending.pop())
            sched.add(added[-1])
        if added and rng.random() < abort_rate:
            done.update(r.request_id for r in sched.abort(rng.choice(added).request_id))
        out = sched.schedule(now=float(t))
        assert adapters_of(s.request for s in out.seqs + out.padding) <= max_loras
        assert adapters_of(sched.running) <= max_loras
        sampled = {s.request.seq_id: Sampled(EOS if rng.random() < 0.1 else 7) for s in out.seqs if s.samples}
        done.update(r.request_id for r in sched.postprocess(out, sampled, now=float(t)))
        sched.deliver([])
        sched.check_integrity()
        if not pending and not sched.has_work:
            break
    assert not sched.has_work, "a request starved"
    assert done >= {r.request_id for r in added if r.status.finished}
    assert all(r.status.finished for r in added)
    assert sched.blocks.num_used_blocks == 0
