"""Multi-LoRA in the engine against the oracle: transformers with each adapter merged into the base
weights by PEFT (merge_and_unload), greedy, token for token. Adapters are PEFT's own files (random
low-rank weights, tests/lora_adapters.py), on the embedded tiny model here and on SmolLM2 in
test_lora_smollm2.py. Requests of three adapters and of none share the same steps."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from backend import LLM, LoRARequest, SamplingParams
from backend.models.make_model import make_model
from lora_adapters import AdapterSpec, make_adapter, merged_oracle, record_steps

MAX_TOKENS = 10
# a: every projection; b: q and v only (k's slice of the fused qkv stays untouched), rsLoRA;
# c: the MLP and k, per-module ranks and alphas (PEFT's rank_pattern / alpha_pattern), two layers.
SPECS = {
    "a": AdapterSpec(r=8, alpha=16),
    "b": AdapterSpec(r=16, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True, b_std=0.1),
    "c": AdapterSpec(r=4, alpha=4, targets=("k_proj", "gate_proj", "up_proj", "down_proj"), b_std=0.1,
                     rank_pattern={"down_proj": 12}, alpha_pattern={"up_proj": 10.0}, layers=(1, 3)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tiny")
    base = make_model(root / "base")
    adapters = {name: make_adapter(base, root / name, seed=i + 1, spec=spec) for i, (name, spec) in enumerate(SPECS.items())}
    return base, adapters


def prompts_for(n, seed=0, vocab=2000):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.choice([4, 9, 17, 23, 33]))] for _ in range(n)]


def oracle(base, adapters, prompts, names):
    return merged_oracle(base, adapters, prompts, names, MAX_TOKENS)


def test_three_adapters_and_the_base_mixed_in_one_batch_equal_the_merged_oracle(tiny):
    base, adapters = tiny
    prompts = prompts_for(8, seed=1)
    names = ["a", None, "b", "c", "c", "a", None, "b"]
    llm = LLM(str(base), enable_lora=True, max_loras=3, kv_block_size=16,
              lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()))
    steps = record_steps(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=[LoRARequest(n) if n == "c" else n for n in names])
    want = oracle(base, adapters, prompts, names)
    assert [o.token_ids for o in outs] == want
    assert any(adapters_ == {"a", "b", "c"} and base_rows for adapters_, base_rows in steps), steps
    # each adapter changes the model: the same prompt under every adapter and none differs
    same = [prompts[0]] * 4
    variants = oracle(base, adapters, same, [None, "a", "b", "c"])
    assert len({tuple(v) for v in variants}) == 4
    llm.check_integrity()
    assert llm.stats()["kv_blocks_used"] == 0


def test_max_loras_one_queues_the_other_adapters_and_every_request_matches(tiny):
    base, adapters = tiny
    prompts = prompts_for(6, seed=2)
    names = ["a", "b", None, "c", "a", "b"]
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=16,
              lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()))
    steps = record_steps(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                        lora_request=names)
    assert [o.token_ids for o in outs] == oracle(base, adapters, prompts, names)
    assert steps and max(len(a) for a, _ in steps) == 1  # never two adapters in a step
    assert {n for a, _ in steps for n in a} == {"a", "b", "c"}


def test_prefix_caching_never_shares_kv_between_adapters_or_with_the_base(tiny):
    """The same prompt (three full blocks and a part) under a, b, the base model and a again, one
    after another with prefix caching on: each answer is its own merged model's, and only the
    repeat under a reuses cached blocks. If the cache key ignored the adapter, b and the base would
    reuse a's KV, answer wrongly and count hits."""
    base, adapters = tiny
    prompt = prompts_for(1, seed=3)[0][:1] + list(range(100, 155))   # 56 tokens: 3 blocks + 8
    llm = LLM(str(base), enable_lora=True, max_loras=2, enable_kv_cache_reuse=True, kv_block_size=16,
              lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    hits = []
    got = []
    for name in ("a", "b", None, "a"):
        before = llm.stats()["prefix_cache_hit_tokens"]
        got.append(llm.generate([prompt], params, lora_request=name)[0].token_ids)
        hits.append(llm.stats()["prefix_cache_hit_tokens"] - before)
    assert got == oracle(base, adapters, [prompt] * 4, ["a", "b", None, "a"])
    assert got[0] != got[1] and got[0] != got[2]
    assert hits == [0, 0, 0, 48]


def test_adapters_load_and_unload_at_run_time(tiny):
    base, adapters = tiny
    llm = LLM(str(base), enable_lora=True, max_loras=2)
    assert llm.list_loras() == []
    prompt = prompts_for(1, seed=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"'a' is not loaded; loaded adapters: none"):
        llm.generate(prompt, params, lora_request="a")
    llm.load_lora("a", adapters["a"])
    # vLLM's LoRARequest with a path loads the adapter on first use
    outs = llm.generate(prompt * 2, params, lora_request=["a", LoRARequest("b", 7, str(adapters["b"]))])
    assert [o.token_ids for o in outs] == oracle(base, adapters, prompt * 2, ["a", "b"])
    assert llm.list_loras() == ["a", "b"]
    llm.engine.add_request("busy", prompt[0], params, lora_request="a")
    with pytest.raises(ValueError, match="'a' is in use by 1 request"):
        llm.unload_lora("a")
    while llm.engine.has_work():
        llm.engine.step()
    llm.unload_lora("a")
    assert llm.list_loras() == ["b"]
    with pytest.raises(ValueError, match="'a' is not loaded; loaded adapters: b"):
        llm.generate(prompt, params, lora_request="a")
    llm.load_lora("a", adapters["c"])  # the name again, another adapter: its own answers
    assert llm.generate(prompt, params, lora_request="a")[0].token_ids == oracle(base, adapters, prompt, ["c"])[0]


def test_lora_off_refuses_adapter_names_saying_how_to_turn_it_on(tiny):
    base, _ = tiny
    llm = LLM(str(base))
    with pytest.raises(ValueError, match="LoRA is not enabled.*enable_lora=true"):
        llm.generate([[1, 5, 6]], SamplingParams(max_tokens=2), lora_request="a")


def test_multi_lora_json_in_the_checkpoint_folder_is_loaded(tiny, tmp_path):
    base, adapters = tiny
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in Path(base).iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "multi_lora.json").write_text('{"alpha": "%s", "gamma": "%s"}' % (adapters["a"], adapters["c"]))
    llm = LLM(str(folder), enable_lora=True, max_loras=2, lora_modules=f"beta={adapters['b']}")
    assert llm.list_loras() == ["alpha", "gamma", "beta"]


@pytest.mark.slow
def test_the_triton_kernels_path_gives_the_same_tokens(tiny):
    """attention_backend=triton (the interpreter here, CUDA on a GPU): the segmented kernels
    (kernels/gpu/lora_sgmv.py), warmed up at start, give the reference path's tokens on a mixed batch."""
    base, adapters = tiny
    prompts = prompts_for(4, seed=5)
    names = ["a", None, "b", "c"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    modules = ",".join(f"{n}={p}" for n, p in adapters.items())
    want = LLM(str(base), enable_lora=True, max_loras=3, lora_modules=modules).generate(prompts, params, lora_request=names)
    from kernels.gpu import launch
    with launch.recording() as warm:
        llm = LLM(str(base), enable_lora=True, max_loras=3, lora_modules=modules, attention_backend="triton")
    assert sorted({w.name for w in warm if w.name.startswith("lora")}) == ["lora_expand_kernel", "lora_shrink_kernel"]
    got = llm.generate(prompts, params, lora_request=names)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
