"""Speculative decoding in the engine: greedy outputs with speculation are token for token those
without it, for both proposers, under every setting that shapes a token (stop strings, stop
tokens, min_tokens, penalties, bad words, max_tokens, n > 1, prefix caching, preemption), and a
draft model equal to the target accepts every draft (a test of the mechanics)."""
from __future__ import annotations

import random

import pytest

from backend import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
COMMON = dict(cpu_kv_cache_tokens=8192, kv_block_size=16)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (so n-grams match) with lengths off the block multiples."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 2000) for _ in range(48)]
    return [base[:rng.randint(5, 40)] * rng.randint(1, 3) + [rng.randrange(3, 2000) for _ in range(rng.randint(1, 9))]
            for _ in range(n)]


@pytest.fixture(scope="module")
def engines(default_model_dir):
    path = str(default_model_dir)
    draft = {"model": path, "num_speculative_tokens": 3}
    made = {"plain": LLM(path, **COMMON), "ngram": LLM(path, speculative_config=NGRAM, **COMMON),
            "draft": LLM(path, speculative_config=draft, **COMMON)}
    yield made


def run(llm: LLM, ps, params):
    outs = llm.generate(ps, params)
    llm.check_integrity()
    assert llm.stats()["kv_blocks_used"] == 0
    return outs


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_outputs_are_those_without_speculation(engines, proposer):
    ps = prompts(10)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (1, 2, 3, 7, 17, 30, 33, 40, 5, 9)]
    ref = run(engines["plain"], ps, params)
    llm = engines[proposer]
    before = llm.stats()
    out = run(llm, ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.text for o in out] == [o.text for o in ref]
    after = llm.stats()
    drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafts > 20 and accepted > 0, (drafts, accepted)
    if proposer == "draft":  # the draft is the target: every draft is the target's own choice
        assert accepted == drafts


def test_settings_that_shape_tokens_are_applied_at_every_position(engines):
    """Penalties, bad words and min_tokens bans at a draft's position see the output followed by
    the drafts before it: with them on, outputs still equal decoding one token at a time."""
    ps = prompts(8, seed=1)
    ref_text = run(engines["plain"], ps[:1], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    settings = [dict(repetition_penalty=1.3), dict(presence_penalty=0.8), dict(frequency_penalty=0.6),
                dict(bad_words=[w for w in ref_text.split() if len(w) > 2][:2] or ["the"]),
                dict(min_tokens=20, stop_token_ids=[5, 7, 11]), dict(repetition_penalty=0.8, frequency_penalty=-0.5),
                dict(logprobs=3), dict(max_tokens=3),
                # issue 43's knobs (a bias, allowed tokens, min_p, prompt logprobs) at every position too
                dict(logit_bias={t: 4.0 for t in range(100, 2000, 37)}, allowed_token_ids=list(range(3, 2000, 2)) + [5],
                     min_p=0.2, prompt_logprobs=2)]
    params = [SamplingParams(**{"max_tokens": 24, "temperature": 0.0, **s}) for s in settings]
    ref = run(engines["plain"], ps + ps[:1], params)
    for name in ("ngram", "draft"):
        out = run(engines[name], ps + ps[:1], params)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref], name
        assert out[8].prompt_logprobs == ref[8].prompt_logprobs and len(ref[8].prompt_logprobs) == len(ps[0])
        for a, b in zip(out[6].logprobs, ref[6].logprobs):  # logprobs of the accepted tokens, raw logits
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


def test_a_stop_inside_a_verified_run_ends_the_output_there(engines):
    """Stop strings and stop tokens that complete in the middle of a step's accepted drafts: the
    tokens after them are never returned, as without speculation."""
    ps = prompts(6, seed=2)
    free = run(engines["plain"], ps, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    params = []
    for o in free:
        words = o.text.split()
        stop = words[len(words) // 2][:3] if len(words) > 2 else "x"
        params.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))
    params += [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[free[0].token_ids[9]])]
    ps += ps[:1]
    ref = run(engines["plain"], ps, params)
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 30 for o in ref)
    for name in ("ngram", "draft"):
        out = run(engines[name], ps, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in out] == [(o.token_ids, o.text, o.finish_reason) for o in ref]


def test_n_completions_and_prefix_caching(default_model_dir):
    path = str(default_model_dir)
    ps = prompts(6, seed=3)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2)
    ref = run(LLM(path, enable_kv_cache_reuse=True, **COMMON), ps + ps, params)
    llm = LLM(path, enable_kv_cache_reuse=True, speculative_config=NGRAM, **COMMON)
    out = run(llm, ps + ps, params)
    assert [[s.token_ids for s in o.samples] for o in out] == [[s.token_ids for s in o.samples] for o in ref]
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


def test_max_utilization_under_pressure_speculates_without_preempting_for_drafts(default_model_dir):
    """A cache too small for the batch: preemptions happen as without speculation, outputs are
    identical, and the blocks drafts took come back."""
    path = str(default_model_dir)
    ps = prompts(12, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    small = dict(cpu_kv_cache_tokens=16 * 24, kv_block_size=16, batch_scheduler_policy="max_utilization",
                 inter_token_target_ms=0)  # unpaced: preemptions that do not follow step times (test_engine_vs_hf.py)
    plain = LLM(path, **small)
    ref = run(plain, ps, params)
    llm = LLM(path, speculative_config=NGRAM, **small)
    out = run(llm, ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert plain.stats()["num_preemptions"] > 0


def test_a_draft_equal_to_the_target_gives_k_plus_one_tokens_a_step(default_model_dir):
    """Every step after the prefill verifies k drafts, accepts them all and adds the bonus token:
    accepted drafts' KV counts as computed (nothing is run twice) and the last step's drafts stop
    at max_tokens."""
    path = str(default_model_dir)
    llm = LLM(path, speculative_config={"model": path, "num_speculative_tokens": 3}, **COMMON)
    llm.engine.add_request("a", prompts(1, seed=5)[0], SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True))
    per_step = []
    while llm.engine.has_work():
        per_step += [len(o.new_token_ids) for o in llm.engine.step()]
    assert per_step == [1] + [4] * 10
    llm.check_integrity()


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_seeded_request_draws_from_its_own_stream(engines, proposer):
    """At temperature > 0 a request's tokens come from its own seeded stream: the same alone or
    among others, while the budget lets every row have its drafts."""
    ps = prompts(5, seed=6)
    seeded = SamplingParams(max_tokens=25, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run(engines[proposer], ps[:1], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True) for m in (7, 30, 12, 20)]
    batched = run(engines[proposer], ps, [seeded] + others)[0].token_ids
    assert alone == batched


@pytest.mark.parametrize("backend, n, max_tokens", [("torch", 8, 16), pytest.param("triton", 1, 9, marks=pytest.mark.slow)])
def test_verify_rows_as_prefill_chunks(default_model_dir, backend, n, max_tokens):
    """Off the CPU fast path (the GPU's Triton kernels, here under the interpreter, and the torch
    references) a verify row is a multi-token chunk read by prefill attention: same tokens as the
    references without speculation."""
    path = str(default_model_dir)
    ps = prompts(n, seed=8)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref = run(LLM(path, **COMMON, attention_backend="torch"), ps, params)
    llm = LLM(path, speculative_config={"model": path, "num_speculative_tokens": 3}, attention_backend=backend,
              **COMMON)
    out = run(llm, ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert llm.stats()["spec_decode_num_accepted_tokens"] == llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_batching_mode_none_speculates_too(default_model_dir):
    path = str(default_model_dir)
    ps = prompts(4, seed=9)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    ref = run(LLM(path, batching_mode="none", **COMMON), ps, params)
    llm = LLM(path, batching_mode="none", speculative_config={"model": path, "num_speculative_tokens": 2}, **COMMON)
    assert [o.token_ids for o in run(llm, ps, params)] == [o.token_ids for o in ref]
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes(default_model_dir, tmp_path):
    from backend.models.make_model import make_model

    other = make_model(tmp_path / "wide", vocab_size=2048)
    with pytest.raises(ValueError, match="the draft's vocabulary has 2048 tokens, the target's 2000"):
        LLM(str(default_model_dir), speculative_config={"model": str(other), "num_speculative_tokens": 2}, **COMMON)
    with pytest.raises(ValueError, match=r"speculative_config.max_model_len \(9000\) exceeds what the draft supports \(4096\)"):
        LLM(str(default_model_dir), speculative_config={"model": str(default_model_dir), "num_speculative_tokens": 2,
                                                        "max_model_len": 9000}, **COMMON)


def test_constrained_rows_do_not_speculate_and_stay_valid(engines):
    """Structured outputs: a constrained request gets no drafts (its grammar would have to follow
    and roll back each one); unconstrained ones beside it still speculate."""
    import re

    regex = r"(ab|cd){2,6}x"
    ps = prompts(3, seed=10)
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs={"regex": regex}),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, structured_outputs={"regex": regex}),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    ref = run(engines["plain"], ps, params)
    llm = engines["draft"]
    before = llm.stats()["spec_decode_num_draft_tokens"]
    out = run(llm, ps, params)
    assert all(re.fullmatch(regex, o.text) for o in out[:2])
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert llm.stats()["spec_decode_num_draft_tokens"] - before <= 3 * 29  # the free row's drafts only
    alone = llm.stats()["spec_decode_num_draft_tokens"]
    run(llm, ps[:2], params[:2])
    assert llm.stats()["spec_decode_num_draft_tokens"] == alone


def test_a_proposal_that_raises_runs_the_step_without_drafts_and_is_counted(default_model_dir, caplog):
    """Drafts are optional: a proposer error leaves the outputs those without speculation, and the
    engine counts it (spec_decode_num_failed_proposals, exported as a metric) and logs it."""
    path = str(default_model_dir)
    ps, params = prompts(4, seed=7), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = run(LLM(path, **COMMON), ps, params)
    llm = LLM(path, speculative_config=NGRAM, **COMMON)
    proposer = llm.engine.speculator.proposer
    inner, calls = proposer.propose, []

    def flaky(rows):  # every other proposal raises
        calls.append(len(rows))
        if len(calls) % 2:
            raise RuntimeError("proposer bug")
        return inner(rows)

    proposer.propose = flaky
    out = run(llm, ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    stats = llm.stats()
    assert stats["spec_decode_num_failed_proposals"] == (len(calls) + 1) // 2 > 0
    assert stats["spec_decode_num_draft_tokens"] > 0   # the other steps still speculate
    assert "speculative proposal failed" in caplog.text and "proposer bug" in caplog.text
