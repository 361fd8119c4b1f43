"""Multi-LoRA on SmolLM2-135M-Instruct (float32): three PEFT adapters and the base model in one
in-flight batch, greedy, token for token against transformers with each adapter merged by PEFT
(merge_and_unload); rank 16 on every projection, rank 8 on attention only, rsLoRA on the MLP."""
from __future__ import annotations

import pytest

from backend import LLM, SamplingParams
from backend.text.tokenizer import Tokenizer
from lora_adapters import AdapterSpec, make_adapter, merged_greedy, merged_oracle, record_steps
from smollm2 import smollm2_dir

MAX_TOKENS = 8
SPECS = {
    "all16": AdapterSpec(r=16, alpha=32, b_std=0.05),
    "attn8": AdapterSpec(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"), b_std=0.12),
    # rsLoRA at rank 8: alpha / sqrt(r) is 2.8x alpha / r, enough to change its greedy answers
    "mlp_rs": AdapterSpec(r=8, alpha=8, targets=("gate_proj", "up_proj", "down_proj"), use_rslora=True, b_std=0.12),
}
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:",
           "The weather today", "1, 2, 3, 4,", "Here is a short story about the sea:"]
NAMES = ["all16", None, "mlp_rs", "attn8", "all16", None, "mlp_rs"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = smollm2_dir()
    root = tmp_path_factory.mktemp("lora-smollm2")
    adapters = {n: make_adapter(base, root / n, seed=i + 11, spec=s) for i, (n, s) in enumerate(SPECS.items())}
    tok = Tokenizer.from_dir(base)
    return base, adapters, [tok.encode(p) for p in PROMPTS]


def test_smollm2_three_adapters_and_the_base_in_one_batch_equal_the_merged_oracle(setup):
    base, adapters, prompts = setup
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_model_len=256,
              max_tokens_in_paged_kv_cache=4096, lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()))
    steps = record_steps(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=NAMES)
    assert any(names == set(SPECS) and base_rows for names, base_rows in steps), steps  # all in one step
    want = merged_oracle(base, adapters, prompts, NAMES, MAX_TOKENS)
    assert [o.token_ids for o in outs] == want
    # every adapter matters: on each of its prompts it answers otherwise than the base model
    base_answers = merged_greedy(base, None, prompts, [MAX_TOKENS] * len(prompts))
    assert all((base_answers[i] != want[i]) == (n is not None) for i, n in enumerate(NAMES)), (base_answers, want)
