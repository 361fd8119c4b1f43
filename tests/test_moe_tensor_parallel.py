"""Mixture-of-experts models under tensor parallelism (backend/models/parallel/plan.py): each of 2 ranks
holds half of every expert's intermediate dimension and the router whole; greedy tokens and
log-probabilities equal one rank's, with no collective beyond the dense model's."""
import numpy as np
import pytest

from backend import LLM
from backend.models.moe import SparseMoeBlock
from hf_checkpoints import make_checkpoint
from tp_helpers import greedy, random_prompts, tp_workers


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_tp2_equals_one_rank(arch, tmp_path):
    path = make_checkpoint(arch, tmp_path / arch, seed=2)
    prompts, params = random_prompts(8, seed=3, vocab=512), greedy(8, logprobs=2)
    one = LLM(str(path), max_model_len=128)
    expected = one.generate(prompts, params)
    with LLM(str(path), max_model_len=128, tensor_parallel_size=2) as two:
        got = two.generate(prompts, params)
        runner = two.engine.runner
        moe = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
        whole = [m for m in one.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        assert moe and runner.model_cfg.moe_intermediate_size == whole[0].experts.intermediate // 2
        assert moe[0].experts.intermediate == whole[0].experts.intermediate // 2   # half of every expert
        assert moe[0].gate.out_features == whole[0].gate.out_features              # the router whole
        calls = runner.tp.stats()["calls"]
        layers = runner.model_cfg.num_layers
        assert calls["all_reduce"] == calls["step_message"] * (2 * layers + 1)    # as a dense model's
        assert len(tp_workers()) == 1
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-4)


@pytest.mark.slow
def test_tp2_on_packed_experts_matches_one_rank(tmp_path):
    """A quantized Mixtral GGUF import keeps its experts packed and stacked [E, ...]; at TP=2 each
    array is cut one dimension in. Packed weights quantize the activations per 32 values, so the
    all-reduce's rounding may move a logprob slightly and flip a near tie (docs/parallelism.md):
    tokens agree up to such a tie, and the log-probabilities where they agree stay close; a wrong
    cut moves them by whole units."""
    from backend.models.gguf.importer import import_gguf
    from backend.models.make_model import make_model
    from backend.models.quant_linear import QuantLinear
    from gguf_files import write_moe_gguf

    hf = make_checkpoint("mixtral", tmp_path / "hf", seed=6, vocab_size=2000, intermediate_size=128)
    write_moe_gguf(tmp_path / "m.gguf", make_model(tmp_path / "tok") / "tokenizer.json", hf, types=("Q8_0", "Q4_0"))
    packed = import_gguf(tmp_path / "m.gguf", tmp_path / "packed", log=lambda *_: None)
    prompts, params = random_prompts(8, seed=4, vocab=2000), greedy(6, logprobs=2)
    want = LLM(str(packed), max_model_len=128).generate(prompts, params)
    with LLM(str(packed), max_model_len=128, tensor_parallel_size=2) as two:
        experts = two.engine.runner.model.layers[0].mlp.inner.experts
        assert isinstance(experts.down[0], QuantLinear) and experts.down[0].in_features == 64   # half of 128
        got = two.generate(prompts, params)
    same = 0
    for a, b in zip(want, got):
        agree = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        same += agree == len(a.token_ids)
        for i in range(min(agree + 1, len(a.token_ids))):   # every step up to the first difference
            top = a.logprobs[i]
            if i == agree:                                    # a flip: only at a near tie
                gap = abs(float(np.subtract(*[lp.logprob for lp in top.values()])))
                assert b.token_ids[i] in top and gap < 0.3, (i, gap)
            else:
                assert b.logprobs[i][a.token_ids[i]].logprob == pytest.approx(top[a.token_ids[i]].logprob, abs=0.15)
    assert same >= 6, f"only {same} of 8 prompts agree"
