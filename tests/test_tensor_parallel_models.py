"""Tensor parallelism of Qwen3 and Gemma 3 (issue 32): two gloo ranks on this CPU give one rank's
greedy tokens and log-probabilities. Each rank holds half the heads; the q/k norms (one weight of
head_dim that every head shares), Gemma's four norms per layer and its scaled embedding are whole
on both, and the local layers' windows apply on each rank's own heads."""
import pytest

from backend import LLM
from hf_checkpoints import make_checkpoint
from tp_helpers import greedy, random_prompts


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_tp2_matches_one_rank(arch, tmp_path):
    path = make_checkpoint(arch, tmp_path / arch, seed=2)
    prompts, params = random_prompts(8, seed=3, vocab=512), greedy(10, logprobs=2)
    prompts.append(prompts[0] * 3)   # several of the tiny Gemma's 13-token windows
    one = LLM(str(path), max_model_len=256).generate(prompts, params)
    with LLM(str(path), max_model_len=256, tensor_parallel_size=2) as two:
        got = two.generate(prompts, params)
        runner = two.engine.runner
        assert runner.model_cfg.num_heads == 2 and runner.model_cfg.num_kv_heads == 1
        assert runner.model_cfg.layer_windows == one_rank_windows(path)
    assert [o.token_ids for o in got] == [o.token_ids for o in one]
    for a, b in zip(one, got):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def one_rank_windows(path):
    from backend.models.loader import load_model_config
    return load_model_config(path).layer_windows
