"""enable_kv_cache_reuse: requests that share a prompt prefix reuse its cached blocks, and greedy
tokens stay identical to transformers'."""
import random

import pytest

from backend import LLM, SamplingParams
from hf_checkpoints import hf_greedy, make_checkpoint


@pytest.fixture(scope="module")
def shared_prefix_case(tmp_path_factory):
    path = make_checkpoint("llama", tmp_path_factory.mktemp("llama-prefix"), seed=3)
    rng = random.Random(7)
    system = [rng.randrange(3, 512) for _ in range(53)]  # 3 full blocks of 16 and a partial one
    prompts = [system + [rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    prompts += [system[:16], system[:17], system + system[:5]]  # a prompt that is exactly one block
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    return path, prompts, max_tokens, hf_greedy(path, prompts, max_tokens)


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_shared_prefixes_are_reused_and_exact(shared_prefix_case, policy):
    path, prompts, max_tokens, expected = shared_prefix_case
    llm = LLM(str(path), enable_kv_cache_reuse=True, kv_block_size=16, max_tokens_in_paged_kv_cache=512,
              batch_scheduler_policy=policy, max_num_batched_tokens=64, max_num_seqs=4)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in max_tokens]
    first = llm.generate(prompts[:1], params[:1])  # warms the cache with the shared prefix
    outputs = first + llm.generate(prompts[1:], params[1:])
    assert [o.token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] >= 16 * 3 * 10, stats
    assert stats["kv_blocks_used"] == 0
    llm.check_integrity()


def test_reuse_off_computes_everything(shared_prefix_case):
    path, prompts, max_tokens, expected = shared_prefix_case
    llm = LLM(str(path), kv_block_size=16, max_tokens_in_paged_kv_cache=512, enable_kv_cache_reuse=False)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in max_tokens])
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
