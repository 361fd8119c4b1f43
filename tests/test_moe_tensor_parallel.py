"""Mixture-of-experts models under tensor parallelism (backend/parallel/plan.py): each of 2 ranks
holds half of every expert's intermediate dimension and the router whole; greedy tokens and
log-probabilities equal one rank's, with no collective beyond the dense model's."""
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
