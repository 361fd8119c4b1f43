"""Sampling semantics on the default model: seeds, top-k/top-p, min_tokens, stop tokens/strings."""
import pytest

from backend import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_num_seqs=16)


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate(["the scheduler"], p)[0].token_ids
    crowd = llm.generate(["other prompt %d" % i for i in range(5)] + ["the scheduler"],
                         [SamplingParams(max_tokens=9, temperature=1.0, seed=i) for i in range(5)] + [p])
    assert crowd[-1].token_ids == alone
    other_seed = llm.generate(["the scheduler"], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99))
    assert other_seed[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(["paged caches"], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    top1 = llm.generate(["paged caches"], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=5))[0]
    assert top1.token_ids == greedy
    tiny_p = llm.generate(["paged caches"], SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=5))[0]
    assert tiny_p.token_ids == greedy


def test_stop_token_and_min_tokens(llm):
    greedy = llm.generate(["blocks"], SamplingParams(max_tokens=10, temperature=0))[0].token_ids
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    out = llm.generate(["blocks"], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop"
    # min_tokens forbids that token until enough were generated
    late = llm.generate(["blocks"], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at],
                                                    min_tokens=first + 2))[0]
    assert len(late.token_ids) >= first + 2
    assert stop_at not in late.token_ids[:first + 1]


def test_stop_string_cuts_the_text(llm):
    full = llm.generate(["a request"], SamplingParams(max_tokens=24, temperature=0))[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and len(text) > 6
    out = llm.generate(["a request"], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]


@pytest.mark.parametrize("kwargs, words", [
    ({"max_tokens": 0}, ["max_tokens", ">= 1"]),
    ({"temperature": -1.0}, ["temperature", ">= 0"]),
    ({"temperature": float("nan")}, ["temperature", "finite"]),
    ({"top_p": 0.0}, ["top_p", "(0, 1]"]),
    ({"top_p": 1.5}, ["top_p", "(0, 1]"]),
    ({"top_k": -2}, ["top_k", ">= -1", "-1 or 0 disables it"]),
    ({"repetition_penalty": 0.0}, ["repetition_penalty", "> 0"]),
    ({"min_tokens": 5, "max_tokens": 2}, ["min_tokens", "max_tokens=2"]),
])
def test_bad_sampling_params_are_refused(kwargs, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_bad_prompts_are_refused_with_limits(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"token id 99999 is outside the vocabulary \[0, 2000\)"):
        llm.generate([[1, 99999]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=100_000))
    assert llm.stats()["kv_blocks_used"] == 0
