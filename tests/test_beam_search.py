"""Beam search in the engine (backend/sched/beams.py): the beams token-equal to transformers'
generate(num_beams=N, do_sample=False) on two tiny random models, their KV blocks shared
copy-on-write (fewer blocks used than beams x length), the no-evict reservation, cancellation and
the pool back to idle, the metrics."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from backend.worker.block_copy import copy_blocks, copy_blocks_reference
from hf_checkpoints import make_checkpoint

BLOCK = 16
PROMPTS = [[5, 17, 99, 200, 31, 7, 8, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55],  # 19 tokens
           [(7 * i + 3) % 500 + 3 for i in range(37)]]  # 37: two full blocks and a part

def beams(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, use_beam_search=True, **kw)

@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    import transformers as tf
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(str(path), kv_block_size=BLOCK, max_tokens_in_paged_kv_cache=1024, max_num_batched_tokens=64,
              enable_chunked_context=True)
    yield request.param, hf, llm
    llm.close()

def hf_beams(hf, prompt, width, n, max_tokens, eos, length_penalty=1.0, early_stopping=False):
    out = hf.generate(torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=max_tokens,
                      num_return_sequences=n, eos_token_id=eos, pad_token_id=0, length_penalty=length_penalty,
                      early_stopping=early_stopping)
    return [row[len(prompt):] for row in out.tolist()]

# (prompt, width, n, max_tokens, stop ids, length_penalty, early_stopping): stop ids (EOS to beam search,
# beside the model's own, 2) that the beams of both models meet, so that hypotheses finish early
CASES = [(0, 2, 2, 9, [], 1.0, False), (0, 4, 4, 10, [80, 309], 1.0, False), (1, 4, 3, 9, [38, 269], 1.0, True),
         (1, 2, 2, 8, [26, 37], 0.5, "never"), (0, 4, 2, 10, [12, 102], 2.0, False)]


def test_beams_token_equal_to_transformers(model):
    arch, hf, llm = model
    prompts = [PROMPTS[c[0]] for c in CASES]
    params = [beams(best_of=w, n=n, max_tokens=t, stop_token_ids=e, length_penalty=lp, early_stopping=es, logprobs=0)
              for _, w, n, t, e, lp, es in CASES]
    outputs = llm.generate(prompts, params)  # all five searches run together
    stopped = 0
    for (p, w, n, t, e, lp, es), out in zip(CASES, outputs):
        eos = [2, *e]
        expected = hf_beams(hf, PROMPTS[p], w, n, t, eos, lp, es)
        got = [s.token_ids for s in out.samples]
        assert len(got) == n
        for g, x in zip(got, expected):  # transformers pads the shorter ones with its first EOS id (2)
            assert g == x[:len(g)] and all(tok == 2 for tok in x[len(g):]), (arch, p, w, got, expected)
        for s in out.samples:  # each beam's own tokens' logprobs (TensorRT-LLM's output_log_probs), teacher-forced
            with torch.no_grad():
                table = torch.log_softmax(hf(torch.tensor([PROMPTS[p] + s.token_ids])).logits[0, len(PROMPTS[p]) - 1:-1]
                                          .float(), -1)
            want = [table[k, tok].item() for k, tok in enumerate(s.token_ids)]
            assert [step[tok].logprob for tok, step in zip(s.token_ids, s.logprobs)] == pytest.approx(want, abs=1e-3)
            assert s.cumulative_logprob == pytest.approx(sum(want), abs=1e-3)
        reasons = [s.finish_reason for s in out.samples]
        assert reasons == ["stop" if g[-1] in eos else "length" for g in got]
        stopped += reasons.count("stop")
    assert stopped >= 3, "too few hypotheses ended on a stop id: the cases test max_tokens only"
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_beams_running"] == 0
    assert stats["beam_requests_total"] >= len(CASES)
    llm.check_integrity()

def test_beams_share_blocks_and_the_reservation_counts_them(model):
    _, _, llm = model
    engine = llm.engine
    prompt, width, max_tokens = PROMPTS[1], 4, 12  # 37 + 12 = 49 tokens: 4 blocks a beam unshared
    engine.add_request("share", prompt, beams(best_of=width, n=2, max_tokens=max_tokens, ignore_eos=True))
    need = -(-(len(prompt) + max_tokens - 1) // BLOCK)
    shared_prompt = (len(prompt) - 1) // BLOCK
    peak, reserved, copies, finals = 0, set(), 0, []
    while engine.has_work():
        outs = engine.step()
        assert all(o.finished for o in outs), "a beam request streams nothing before its search ends"
        finals += outs
        stats = engine.stats()
        peak = max(peak, stats["kv_blocks_used"])
        if stats["num_beams_running"] == width and stats["kv_blocks_used"]:
            reserved.add(stats["kv_blocks_reserved"])
        copies += len(engine.beams.copies)
        engine.check_integrity()
    assert len(finals) == 2 and all(len(o.token_ids) == max_tokens for o in finals)
    assert peak < width * need, f"peak {peak} blocks: the beams shared none of their {width} x {need}"
    assert peak <= shared_prompt + width * (need - shared_prompt)
    # guaranteed_no_evict reserves the prompt's shared blocks once and each beam's own growth, never less
    assert max(reserved) == shared_prompt + width * (need - shared_prompt)
    assert copies > 0, "no beam took another's history: the case does not test copy-on-write"
    assert engine.stats()["kv_blocks_used"] == 0
    # with the prefix cache (on by default): the same search again takes the prompt's full blocks
    # from it and returns the same beams
    again = llm.generate([prompt], beams(best_of=width, n=2, max_tokens=max_tokens, ignore_eos=True))[0]
    assert again.num_cached_tokens == shared_prompt * BLOCK
    assert [s.token_ids for s in again.samples] == [o.token_ids for o in sorted(finals, key=lambda o: o.index)]

def test_cancelling_a_beam_request_frees_every_beam(model):
    _, _, llm = model
    engine = llm.engine
    engine.add_request("gone", PROMPTS[0], beams(best_of=4, n=3, max_tokens=20, ignore_eos=True))
    for _ in range(6):
        assert not [o for o in engine.step() if o.finished]
    assert engine.stats()["num_beams_running"] == 4 and engine.stats()["kv_blocks_used"] > 0
    finals = engine.abort("gone")
    assert sorted(o.index for o in finals) == [0, 1, 2] and {o.finish_reason for o in finals} == {"abort"}
    while engine.has_work():
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_beams_running"] == 0
    engine.check_integrity()

def test_a_failed_step_ends_the_search_with_one_error_per_returned_beam(model, monkeypatch):
    _, _, llm = model
    engine = llm.engine
    engine.add_request("boom", PROMPTS[0], beams(best_of=3, n=2, max_tokens=8, ignore_eos=True))
    for _ in range(4):
        assert not engine.step()
    monkeypatch.setattr(engine.runner, "execute", lambda plan: (_ for _ in ()).throw(RuntimeError("injected")))
    finals = engine.step()
    monkeypatch.undo()
    assert sorted(o.index for o in finals) == [0, 1] and {o.finish_reason for o in finals} == {"error"}
    while engine.has_work():
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_beams_running"] == 0
    engine.check_integrity()


def test_what_the_engine_cannot_run_beams_with_is_refused():
    from types import SimpleNamespace

    from backend.sched.beams import refuse_beams
    p = beams(best_of=2)
    for config, message in ((dict(speculative=object()), "speculative decoding"),
                            (dict(batch_scheduler_policy="max_utilization"), "guaranteed_no_evict"),
                            (dict(batching_mode="static"), "batching_mode static")):
        config = SimpleNamespace(**{"speculative": None, "batch_scheduler_policy": "guaranteed_no_evict",
                                    "batching_mode": "inflight", **config})
        with pytest.raises(ValueError, match=message):
            refuse_beams(p, config, None, 5)


def test_block_copies_equal_the_reference():
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(6, 3, 2, 4, generator=gen), torch.randn(6, 3, 2, 4, generator=gen)) for _ in range(2)]
    caches.append(caches[0])  # a tensor two layers share is copied once
    want = [(k.clone(), v.clone()) for k, v in caches[:2]]
    copy_blocks_reference(want, [(1, 4), (2, 5)])
    copy_blocks(caches, [(1, 4), (2, 5)])
    for (k, v), (wk, wv) in zip(caches, want + [want[0]]):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    with pytest.raises(ValueError, match="distinct fresh"):
        copy_blocks(caches, [(1, 4), (4, 5)])

@pytest.mark.parametrize("field,value", [("temperature", 0.7), ("stop", ["x"]), ("logprobs", 2), ("top_k", 5)])
def test_what_beams_do_not_compose_with_is_refused_by_name(field, value):
    kw = {"temperature": 0.0, field: value}
    with pytest.raises(ValueError, match=f"^{field} .*not supported with beam search"):
        SamplingParams(use_beam_search=True, best_of=2, **kw)
    with pytest.raises(ValueError, match="n \\(3\\) must not exceed the beam width"):
        SamplingParams(use_beam_search=True, best_of=2, n=3, temperature=0.0)


def test_two_searches_on_a_tight_cache_take_turns_and_equal_a_roomy_one(model):
    """Six blocks, two searches of five each: the first beam of a search starts only when all its
    beams fit (guaranteed_no_evict), so the second waits for the first instead of starting its
    first beam beside it and both waiting forever for beams that cannot start; both equal the
    searches of a roomy cache."""
    _, _, roomy = model
    params = [beams(best_of=4, n=4, max_tokens=12, ignore_eos=True), beams(best_of=3, n=2, max_tokens=12, ignore_eos=True)]
    expected = [[s.token_ids for s in o.samples] for o in roomy.generate(PROMPTS, params)]
    tight = LLM(str(roomy.engine.config.model_path), kv_block_size=BLOCK, max_tokens_in_paged_kv_cache=6 * BLOCK,
                max_num_batched_tokens=64, enable_chunked_context=True)
    try:
        engine, finals = tight.engine, {}
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            engine.add_request(f"r{i}", prompt, p)
        for _ in range(300):
            for o in engine.step():
                if o.finished:
                    finals[(o.request_id, o.index)] = o.token_ids
            if not engine.has_work():
                break
        assert not engine.has_work(), "the searches wait for each other forever"
        assert [[finals[(f"r{i}", j)] for j in range(p.n)] for i, p in enumerate(params)] == expected
        assert tight.stats()["kv_blocks_used"] == 0
        tight.check_integrity()
        from backend.core.request import Request
        policy = tight.engine.scheduler.policy  # a search's first beam is admitted for all its beams
        assert policy.can_admit(Request("a", PROMPTS[1], beams(best_of=4, n=4, max_tokens=12)), 1)  # 3 + 3 x 1
        assert not policy.can_admit(Request("b", PROMPTS[1], beams(best_of=4, n=4, max_tokens=13)), 1)  # 4 + 3 x 2
        assert policy.can_admit(Request("c", PROMPTS[1], SamplingParams(max_tokens=13, n=4)), 1)  # sampling: 4
        with pytest.raises(ValueError, match=r"^best_of \(4 beams\) .* need 10 KV blocks at once; the cache has 6"):
            tight.generate([PROMPTS[1]], beams(best_of=4, max_tokens=20))  # 4 blocks each, 2 shared
    finally:
        tight.close()
