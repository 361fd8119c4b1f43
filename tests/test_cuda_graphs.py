"""Decode steps through the CUDA graphs' static buffers (backend/worker/cuda_graphs.py). On the CPU the
buffers run eagerly (no capture), with the real Triton kernels under the interpreter: the tokens
must be exactly the eager engine's, greedy and seeded-random, for batches that are not one of the
padded sizes (empty rows fill them), while prefill and mixed steps stay eager. The tiny Gemma 3 too:
its three KV-cache groups (a global layer, two local ones) each have their slot mapping and block
tables in the buffers."""
import random

import pytest

from backend import LLM, SamplingParams
from backend.worker.cuda_graphs import batch_sizes
from hf_checkpoints import make_checkpoint


def test_padded_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(3) == [1, 2, 3]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_sizes(100)[-3:] == [80, 96, 100]


@pytest.fixture(scope="module", params=["llama", pytest.param("gemma3", marks=pytest.mark.slow)])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp("graphs") / request.param, seed=2)


def run(path, enforce_eager: bool):
    llm = LLM(str(path), attention_backend="triton", enforce_eager=enforce_eager, kv_block_size=16,
              max_tokens_in_paged_kv_cache=1024, max_num_seqs=8, max_num_batched_tokens=64)
    runner = llm.engine.runner
    kinds = []
    run_step = runner.execute

    def recording(plan):
        if not plan.is_empty:  # (a plan of no row only tells the worker what left)
            kinds.append("decode" if not plan.prefills and not plan.padding else "mixed")
        return run_step(plan)

    runner.execute = recording
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 9, 30, 5)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 3, 5, 2, 4)]
    params[2] = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    assert llm.stats()["kv_blocks_used"] == 0
    return outs, runner, kinds


@pytest.mark.slow
def test_the_static_buffer_path_gives_exactly_the_eager_tokens(checkpoint):
    eager, eager_runner, _ = run(checkpoint, enforce_eager=True)
    graphed, runner, kinds = run(checkpoint, enforce_eager=False)
    assert eager_runner.decode_path.graphs is None and runner.decode_path.graphs is not None and not runner.decode_path.graphs.graphs  # no capture on CPU
    assert runner.decode_path.graphs.tables.shape[0] == runner.kv_layout.num_groups == (3 if checkpoint.name == "gemma3" else 1)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    # logprobs to float32 rounding: a padded batch's GEMM may block its rows differently (on a GPU too)
    for g, e in zip(graphed, eager):
        if e.logprobs is not None:
            assert [sorted(step) for step in g.logprobs] == [sorted(step) for step in e.logprobs]
            for gs, es in zip(g.logprobs, e.logprobs):
                for token, lp in es.items():
                    assert gs[token].rank == lp.rank and gs[token].logprob == pytest.approx(lp.logprob, abs=1e-5)
    # every pure decode step (one each of 5, 4, 3, 2, 1 rows: sizes 8, 4, 4, 2, 1) went through the buffers
    assert runner.decode_path.graphs.replays == kinds.count("decode") > 3 and "mixed" in kinds
