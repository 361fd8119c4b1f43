"""Speculative decoding on quantized weights (issue 23's default: packed GGUF weights with a
bfloat16 KV cache on CPU, which the verify rows read through the C decode attention): greedy
outputs are token for token those without speculation, a packed draft equal to its target accepts
every draft, and a packed copy of a float checkpoint can draft for it."""
from __future__ import annotations

import pytest
import torch

from backend import LLM, SamplingParams
from backend.models.gguf.importer import import_gguf
from backend.models.make_model import make_model
from gguf_files import write_gguf
from test_spec_engine import NGRAM, prompts, run

SMALL = dict(cpu_kv_cache_tokens=4096, kv_block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A tiny Q4_1 GGUF imported twice: packed as it is, and dequantized to float32 (untied: a
    random tied model only repeats its last token, which no attention bug would change)."""
    tmp = tmp_path_factory.mktemp("q4_1")
    tokenizer_json = make_model(tmp / "tiny") / "tokenizer.json"
    write_gguf(tmp / "model.gguf", tokenizer_json, seed=11, types=("Q4_1",), tied=False)
    quiet = dict(log=lambda *_: None)
    return (str(import_gguf(tmp / "model.gguf", tmp / "packed", **quiet)),
            str(import_gguf(tmp / "model.gguf", tmp / "float", dequantize=True, **quiet)))


def greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]


def accepted_of(llm: LLM) -> tuple[int, int]:
    s = llm.stats()
    return s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


def test_packed_target_speculates_with_outputs_unchanged(packed):
    packed, _ = packed
    ps = prompts(6, seed=21)
    params = greedy([3, 17, 30, 9, 41, 26])
    plain = LLM(packed, **SMALL)
    assert plain.engine.runner.kv_dtype == torch.bfloat16  # the verify rows read a bf16 cache
    ref = run(plain, ps, params)
    for spec in (NGRAM, {"model": packed, "num_speculative_tokens": 3}):
        llm = LLM(packed, speculative_config=spec, **SMALL)
        assert [o.token_ids for o in run(llm, ps, params)] == [o.token_ids for o in ref], spec
        drafts, accepted = accepted_of(llm)
        assert drafts > 20 and accepted > 0, (spec, drafts, accepted)
        if "model" in spec:  # the draft is the target: every draft is the target's own choice
            assert accepted == drafts


def test_a_packed_copy_drafts_for_its_float_checkpoint(packed):
    """Quantized self-drafting: the packed weights propose, the float ones decide."""
    packed, dequantized = packed
    ps = prompts(4, seed=22)
    params = greedy([12, 25, 31, 7])
    ref = run(LLM(dequantized, **SMALL), ps, params)
    llm = LLM(dequantized, speculative_config={"model": packed, "num_speculative_tokens": 3}, **SMALL)
    assert llm.engine.runner.kv_dtype == torch.float32
    assert [o.token_ids for o in run(llm, ps, params)] == [o.token_ids for o in ref]
    drafts, accepted = accepted_of(llm)
    assert drafts > 20 and accepted > 0, (drafts, accepted)
