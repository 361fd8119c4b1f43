"""The pooling runner (docs/pooling.md): embeddings and cross-encoder scores against transformers on
tiny random Qwen3 checkpoints with sentence-transformers files, chunked prompts whose lengths are not
block multiples, pooling and generate requests in one batch, the bad inputs refused naming the field,
and the KV cache back to idle."""
import random

import pytest
import torch

from backend import LLM, PoolingParams, SamplingParams
from hf_checkpoints import hf_greedy
from pooling_models import hf_embeddings, hf_scores, qwen3_pooling_checkpoint

pytestmark = pytest.mark.slow  # several checkpoints, engines and transformers oracles

# chunked: a step takes at most 24 tokens, blocks hold 16; no length is a block multiple
ENGINE = dict(kv_block_size=16, max_num_batched_tokens=24, max_tokens_in_paged_kv_cache=1024, max_num_seqs=4)
LENGTHS = (37, 5, 70, 1, 51)


def _prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item()


def _idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0, stats
    llm.check_integrity()


@pytest.fixture(scope="module")
def last_normalized(tmp_path_factory):
    """Qwen3-Embedding's shape: a bare Qwen3Model, last-token pooling, Normalize."""
    return qwen3_pooling_checkpoint(tmp_path_factory.mktemp("qwen3-embed-last"), "model", seed=1)


@pytest.fixture(scope="module")
def mean_causal(tmp_path_factory):
    """A Qwen3ForCausalLM with mean pooling and no Normalize: it can generate too."""
    return qwen3_pooling_checkpoint(tmp_path_factory.mktemp("qwen3-embed-mean"), "causal", seed=2,
                                    pooling="mean", normalize=False)


@pytest.mark.parametrize("case", ["last_normalized", "mean_causal"])
def test_embeddings_match_transformers(case, request):
    path = request.getfixturevalue(case)
    pooling, normalize = ("last", True) if case == "last_normalized" else ("mean", False)
    prompts = _prompts(3)
    expected = hf_embeddings(path, prompts, pooling, normalize)
    llm = LLM(str(path), **ENGINE)  # runner auto: the sentence-transformers files make it a pooling model
    assert llm.engine.pooling.pooling_type == pooling and llm.engine.pooling.normalize is normalize
    outputs = llm.embed(prompts)
    for out, want in zip(outputs, expected):
        assert len(out.pooled) == 64 and out.finish_reason == "stop" and out.token_ids == []
        assert _cosine(out.pooled, want) >= 0.9999
        assert torch.allclose(torch.tensor(out.pooled), want, atol=1e-4, rtol=1e-3)  # the scale too (mean: unnormalized)
    stats = llm.stats()
    assert stats["pooling_requests_total"] == len(prompts)
    assert stats["pooling_prompt_tokens_total"] == sum(LENGTHS)
    assert stats["generation_tokens_total"] == 0
    # the same prompts again: last-token pooling takes their prefix from the cache, mean computes it all
    again = llm.embed(prompts)
    assert all(_cosine(a.pooled, b) >= 0.9999 for a, b in zip(again, expected))
    assert (llm.stats()["prefix_cache_hit_tokens"] > 0) is (pooling == "last")
    _idle(llm)


def test_pooling_and_generate_requests_share_steps(mean_causal):
    """A causal LM served by the pooling runner keeps its LM head: the Python API mixes both kinds in
    one in-flight batch, each exact (greedy tokens, mean embeddings) and the KV back to idle."""
    gen_prompts, pool_prompts = _prompts(5, (29, 12, 40)), _prompts(6, (45, 9, 66))
    max_tokens = [7, 12, 5]
    expected_tokens = hf_greedy(mean_causal, gen_prompts, max_tokens)
    expected_vectors = hf_embeddings(mean_causal, pool_prompts, "mean", False)
    llm = LLM(str(mean_causal), runner="pooling", **ENGINE)
    engine = llm.engine
    for i, (g, p, n) in enumerate(zip(gen_prompts, pool_prompts, max_tokens)):
        engine.add_request(f"gen-{i}", g, SamplingParams(max_tokens=n, temperature=0))
        engine.add_pooling_request(f"pool-{i}", p)
    done, mixed_steps = {}, 0
    while engine.has_work():
        outs = engine.step()
        kinds = {o.request_id.split("-")[0] for o in outs if o.new_token_ids or o.pooled is not None}
        mixed_steps += kinds == {"gen", "pool"}
        done.update((o.request_id, o) for o in outs if o.finished)
    assert mixed_steps >= 1  # a step that sampled tokens also pooled a prompt
    assert [done[f"gen-{i}"].token_ids for i in range(3)] == expected_tokens
    for i, want in enumerate(expected_vectors):
        assert _cosine(done[f"pool-{i}"].pooled, want) >= 0.9999
    _idle(llm)


def test_rerank_scores_match_sequence_classification(tmp_path):
    path = qwen3_pooling_checkpoint(tmp_path / "qwen3-rerank", "classify", seed=4)
    rng = random.Random(8)
    query = [rng.randrange(3, 512) for _ in range(11)]
    pairs = [query + [rng.randrange(3, 512) for _ in range(n)] for n in (30, 7, 52, 19, 3)]
    expected = hf_scores(path, pairs)
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.pooling.task == "classify"
    scores = [o.pooled[0] for o in llm.classify(pairs)]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert sorted(range(5), key=lambda i: -scores[i]) == sorted(range(5), key=lambda i: -expected[i])
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([query], SamplingParams(max_tokens=2))
    _idle(llm)


def test_bad_pooling_inputs_are_refused_and_nothing_leaks(tmp_path, last_normalized):
    llm = LLM(str(last_normalized), max_model_len=80, **ENGINE)
    for prompt, params, match in (([[]], None, "empty"), ("", None, "empty string"),
                                  ([5] * 81, None, "max_model_len is 80"),
                                  ([5, 6], PoolingParams(dimensions=16), "dimensions: .*Matryoshka"),
                                  ([5, 6], PoolingParams(dimensions=16.5), "dimensions")):
        with pytest.raises(ValueError, match=match):
            llm.embed(prompt, params)
    # truncate_prompt_tokens keeps the last k tokens (vLLM's left truncation)
    long = _prompts(9, (100,))[0]
    [cut] = llm.embed(long, truncate_prompt_tokens=30)
    [tail] = llm.embed(long[-30:])
    assert cut.pooled == pytest.approx(tail.pooled, abs=1e-5) and len(cut.prompt_token_ids) == 30
    [full] = llm.embed([5] * 80)  # a pooling request may fill max_model_len (its prompt's KV only)
    assert len(full.pooled) == 64
    _idle(llm)
    with pytest.raises(ValueError, match="runner generate"):  # a bare decoder has no LM head to generate with
        LLM(str(last_normalized), runner="generate", **ENGINE)


def test_matryoshka_dimensions(tmp_path):
    path = qwen3_pooling_checkpoint(tmp_path / "qwen3-mrl", "model", seed=7, matryoshka_dimensions=[16, 32])
    prompts = _prompts(10, (21, 44))
    llm = LLM(str(path), **ENGINE)
    outs = llm.embed(prompts, PoolingParams(dimensions=16))
    for out, want in zip(outs, hf_embeddings(path, prompts, "last", True, dimensions=16)):
        assert len(out.pooled) == 16 and _cosine(out.pooled, want) >= 0.9999
        assert sum(v * v for v in out.pooled) == pytest.approx(1.0, abs=1e-5)  # cut first, then normalized
    with pytest.raises(ValueError, match="dimensions must be one of 16, 32"):
        llm.embed(prompts, PoolingParams(dimensions=24))
    _idle(llm)


def test_pooling_needs_the_pooling_runner(default_model_dir):
    llm = LLM(str(default_model_dir), max_num_batched_tokens=64)
    assert llm.engine.pooling is None  # runner auto, no sentence-transformers files: it generates
    with pytest.raises(ValueError, match="generate runner.*--runner pooling"):
        llm.embed([5, 6, 7])


def test_qwen3_reranker_yes_no_logits(tmp_path, default_model_dir):
    """Qwen3-Reranker as vLLM serves it (config.json: Qwen3ForSequenceClassification with
    classifier_from_token [no, yes]): the score is P(yes) = softmax(logit_no, logit_yes)[1] at the last
    position of a causal LM. The tiny tokenizer has neither word: "the" and "and" stand in for them."""
    import json

    from pooling_models import hf_last_logits, with_tokenizer
    path = with_tokenizer(qwen3_pooling_checkpoint(tmp_path / "qwen3-reranker", "causal", seed=12, vocab_size=2000,
                                                   sentence_transformers=False), default_model_dir)
    rng = random.Random(13)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (23, 40, 9)]
    logits = hf_last_logits(path, prompts)  # (before config.json says it is a classifier)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["the", "and"])
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), **ENGINE)
    no, yes = llm.tokenizer.token_to_id("the"), llm.tokenizer.token_to_id("and")
    expected = [torch.softmax(torch.stack([l[no], l[yes]]), dim=0)[1].item() for l in logits]
    assert [o.pooled[0] for o in llm.classify(prompts)] == pytest.approx(expected, abs=1e-5)
    _idle(llm)
