"""Speculative decoding beside multi-LoRA: a row of an adapter is verified by the target with its
adapter (the drafts, n-gram or a draft model without adapters, only propose), so greedy outputs
equal the merged-adapter oracle with speculation on, for adapter and base rows in one batch."""
from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from backend.models.make_model import make_model
from lora_adapters import AdapterSpec, make_adapter, merged_oracle
from test_lora_engine import prompts_for

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-lora")
    base = make_model(root / "base")
    return base, {"a": make_adapter(base, root / "a", seed=4, spec=AdapterSpec(r=8, alpha=16)),
                  "b": make_adapter(base, root / "b", seed=5, spec=AdapterSpec(r=4, alpha=8, targets=("q_proj", "down_proj"), b_std=0.1))}


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_adapter_rows_speculate_and_equal_the_merged_oracle(tiny, proposer):
    base, adapters = tiny
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3} \
        if proposer == "ngram" else {"model": str(base), "num_speculative_tokens": 2}
    prompts = prompts_for(6, seed=7)
    prompts = [p + p[1:] for p in prompts]  # repeated spans: the n-gram proposer finds drafts
    names = ["a", None, "b", "a", None, "b"]
    llm = LLM(str(base), enable_lora=True, max_loras=2, kv_block_size=16, speculative_config=spec,
              lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()))
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=names)
    assert [o.token_ids for o in outs] == merged_oracle(base, adapters, prompts, names, MAX_TOKENS)
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    llm.check_integrity()
    assert llm.stats()["kv_blocks_used"] == 0
