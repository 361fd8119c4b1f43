"""Hundreds of requests with speculation (1,000 with n-gram drafts; 400 with a draft model, whose
every step runs the draft too), about a fifth of them cancelled while they are verifying drafts:
no KV block of the target or of the draft model leaks, and the engine's integrity holds throughout."""
from __future__ import annotations

import random

import pytest

from backend import LLM, SamplingParams


@pytest.mark.slow
@pytest.mark.parametrize("proposer, policy, requests", [("draft", "guaranteed_no_evict", 400),
                                                        ("ngram", "max_utilization", 1000)])
def test_no_block_leaks_after_many_requests_with_cancellations_mid_draft(default_model_dir, proposer, policy, requests):
    path = str(default_model_dir)
    spec = ({"model": path, "num_speculative_tokens": 3, "draft_kv_cache_tokens": 2048} if proposer == "draft" else
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    llm = LLM(path, speculative_config=spec, cpu_kv_cache_tokens=3072, kv_block_size=16, max_num_seqs=48,
              batch_scheduler_policy=policy, enable_kv_cache_reuse=True)
    engine = llm.engine
    rng = random.Random(7)
    shared = [rng.randrange(3, 2000) for _ in range(40)]
    added = cancelled_mid_draft = 0
    doomed: set[str] = set()  # chosen when added, so how many are cancelled does not depend on timing
    steps = 0
    while added < requests or engine.has_work():
        for _ in range(rng.randint(0, 6) if added < requests else 0):
            words = rng.sample(shared, rng.randint(2, 12))
            prompt = shared[:rng.randint(0, 33)] + words * rng.randint(1, 3)
            params = SamplingParams(max_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 0.8]),
                                    ignore_eos=rng.random() < 0.5)
            if rng.random() < 0.2:
                doomed.add(f"r{added}")
            engine.add_request(f"r{added}", prompt, params)
            added += 1
        # a doomed request once it decodes with drafts (the pacing's cost model makes the steps'
        # make-up depend on the machine's timing; the requests and which are cancelled do not)
        drafting = [r.request_id for r in engine.scheduler.running
                    if r.num_computed_tokens > r.num_prompt_tokens and r.request_id in doomed]
        for rid in drafting:
            engine.abort(rid)
            doomed.discard(rid)
            cancelled_mid_draft += 1
        engine.step()
        steps += 1
        if steps % 25 == 0:
            engine.check_integrity()
    engine.check_integrity()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0
    assert stats["spec_decode_num_draft_tokens"] > 300 and cancelled_mid_draft > requests // 10, cancelled_mid_draft
    if proposer == "draft":
        assert engine.speculator.proposer.blocks.num_used_blocks == 0
        assert not engine.speculator.proposer.live
