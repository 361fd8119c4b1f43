"""speculative_config: vLLM's keys and defaults, one check in EngineConfig, errors that name the
key and the limit; and the n-gram proposer's semantics (vLLM's prompt lookup)."""
from __future__ import annotations

import json
import random

import pytest

from backend.core.config import EngineConfig
from backend.core.speculative_config import parse_speculative_config
from backend.speculative.ngram import NgramProposer


def test_vllm_keys_and_defaults():
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 5, 5)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert parse_speculative_config({"model": "ngram", "num_speculative_tokens": 2}).method == "ngram"
    draft = parse_speculative_config({"model": "/some/draft", "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    assert (draft.method, draft.model, draft.draft_sample_method) == ("draft_model", "/some/draft", "greedy")
    assert draft.enabled_for(8) and not draft.enabled_for(9)
    assert parse_speculative_config("") is None and parse_speculative_config("{}") is None


@pytest.mark.parametrize("value, words", [
    ('{"method": "ngram"}', ["num_speculative_tokens", "required"]),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ["num_speculative_tokens", "[1, 32]", "0"]),
    ('{"method": "ngram", "num_speculative_tokens": 33}', ["num_speculative_tokens", "[1, 32]"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     ["prompt_lookup_min (4)", "prompt_lookup_max (2)"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 65}', ["prompt_lookup_max", "[1, 64]"]),
    ('{"method": "eagle", "num_speculative_tokens": 2}', ["method", "ngram, draft_model", "eagle"]),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', ["speculative_config.model", "required"]),
    ('{"model": "/d", "num_speculative_tokens": 2, "draft_sample_method": "nucleus"}', ["draft_sample_method", "nucleus"]),
    ('{"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', ["prompt_lookup_max", "draft_model"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', ["disable_by_batch_size", ">= 1"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "speculative_tokens": 3}', ["unknown key", "speculative_tokens"]),
    ('{"method": "ngram", "num_speculative_tokens": "two"}', ["num_speculative_tokens", "two"]),
    ('[1, 2]', ["JSON object", "list"]),
    ('{"method": "ngram",', ["JSON object"]),
])
def test_bad_values_are_refused_naming_the_key(value, words):
    with pytest.raises(ValueError) as err:
        EngineConfig.from_params({"model_path": "m", "speculative_config": value})
    assert all(w in str(err.value) for w in words), str(err.value)


def test_engine_config_takes_json_or_a_dict_and_refuses_padded_batches():
    as_dict = EngineConfig(model_path="m", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert json.loads(as_dict.speculative_config)["num_speculative_tokens"] == 3
    assert as_dict.speculative.num_speculative_tokens == 3
    assert EngineConfig(model_path="m").speculative is None
    with pytest.raises(ValueError, match="batching_mode inflight or none; got 'static'"):
        EngineConfig(model_path="m", batching_mode="static", speculative_config='{"model": "ngram", "num_speculative_tokens": 3}')
    EngineConfig(model_path="m", batching_mode="none", speculative_config='{"model": "ngram", "num_speculative_tokens": 3}')


def reference_lookup(tokens, low, high, k):
    """vLLM's rule written plainly: the longest n in [low, high] whose last-n tokens occur earlier,
    the earliest such occurrence, and up to k tokens after it."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_lookup_matches_the_plain_rule_on_random_sequences():
    rng = random.Random(0)
    checked = proposed = 0
    for _ in range(3000):
        low = rng.randint(1, 4)
        high = rng.randint(low, 6)
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 6)
        got = NgramProposer(low, high).propose(tokens, k)
        assert got == reference_lookup(tokens, low, high, k), (tokens, low, high, k)
        checked += 1
        proposed += bool(got)
    assert proposed > 1000


def test_ngram_examples():
    assert NgramProposer(2, 3).propose([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]  # vLLM's docstring example
    assert NgramProposer(1, 3).propose([9, 1, 2, 7, 1, 2], 2) == [7, 1]
    assert NgramProposer(3, 3).propose([9, 1, 2, 7, 1, 2], 2) == []
    assert NgramProposer(1, 1).propose([5], 3) == []
