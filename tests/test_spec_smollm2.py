"""Speculative decoding on SmolLM2-135M-Instruct: greedy outputs with speculation are token for
token those without it, for the n-gram proposer (on answers that quote the prompt, where it pays)
and for a draft model (SmolLM2 itself: it must accept every draft)."""
import gc

import pytest

from backend import LLM, SamplingParams
from backend.text.tokenizer import Tokenizer
from smollm2 import smollm2_dir

PASSAGE = ("A server waits. Most of its life is spent waiting for a request to arrive, for a disk to answer, "
           "for a network packet to cross the room.")
QUESTIONS = [f"Copy this text exactly:\n\n{PASSAGE}", "What is the capital of France?",
             "List the first five prime numbers, separated by commas."]
ENGINE = dict(dtype="float32", max_model_len=512, max_tokens_in_paged_kv_cache=4096)


@pytest.fixture(scope="module")
def setup():
    path = str(smollm2_dir())
    tok = Tokenizer.from_dir(path)
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS] + [tok.encode("1, 2, 3, 4, 5,")]
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (40, 12, 20, 17)]
    llm = LLM(path, **ENGINE)
    ref = llm.generate(prompts, params)
    del llm
    gc.collect()
    return path, prompts, params, ref


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4},
                                  {"model": "SELF", "num_speculative_tokens": 3}], ids=["ngram", "draft"])
def test_greedy_outputs_are_unchanged(setup, spec):
    path, prompts, params, ref = setup
    spec = {**spec, "model": path} if spec.get("model") == "SELF" else spec
    llm = LLM(path, speculative_config=spec, **ENGINE)
    out = llm.generate(prompts, params)
    stats = llm.stats()
    llm.check_integrity()
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert [o.text for o in out] == [o.text for o in ref]
    assert PASSAGE[:40] in ref[0].text  # the first answer quotes the prompt: what n-grams find
    assert stats["spec_decode_num_accepted_tokens"] > 20
    if "model" in spec:
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    del llm
    gc.collect()
