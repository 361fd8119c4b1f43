"""vLLM's prompt_logprobs against transformers' log_softmax of the prompt, on the tiny random
model: whole prompts and chunked prefills (a budget below the prompt, lengths that are not block
multiples), beside requests that do not ask, with the prefix cache on (a request for prompt
logprobs computes its whole prompt), with n > 1, and a one-token prompt."""
import pytest
import torch

from backend import LLM, SamplingParams

PROMPT = [1] + [5 + (11 * i) % 60 for i in range(36)]  # 37 tokens: not a multiple of the block size


@pytest.fixture(scope="module")
def reference(default_model_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()

    def log_softmax(prompt):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return log_softmax


def check(out, prompt, ref, k):
    """vLLM's shape: None, then per prompt token a dict holding it and the top k, with ranks."""
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entries, row, token = out.prompt_logprobs[pos], ref[pos - 1], prompt[pos]
        assert set(entries) == set(row.topk(k).indices.tolist()) | {token} if k else set(entries) == {token}
        for tok, lp in entries.items():
            assert abs(lp.logprob - float(row[tok])) < 1e-4, (pos, tok)
            assert lp.rank == int((row > row[tok]).sum()) + 1


@pytest.mark.parametrize("chunk", [None, 16, 7])
def test_prompt_logprobs_equal_transformers(default_model_dir, reference, chunk):
    extra = dict(max_num_batched_tokens=chunk, enable_chunked_context=True) if chunk else {}
    llm = LLM(str(default_model_dir), max_num_seqs=4, max_model_len=128, enable_kv_cache_reuse=True, **extra)
    ref = reference(PROMPT)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))[0]  # caches the prompt's blocks
    assert plain.prompt_logprobs is None
    outs = llm.generate([PROMPT, PROMPT[:20]], [SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3),
                                                SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)])
    check(outs[0], PROMPT, ref, 3)
    check(outs[1], PROMPT[:20], ref, 0)
    assert outs[0].token_ids == plain.token_ids  # the output itself unchanged
    assert outs[0].num_cached_tokens == 0  # the cached prefix was not used


def test_prompt_logprobs_with_n_and_a_one_token_prompt(default_model_dir, reference):
    llm = LLM(str(default_model_dir), max_num_seqs=4, max_model_len=128)
    out = llm.generate([PROMPT[:9]], SamplingParams(max_tokens=3, n=2, seed=1, prompt_logprobs=2))[0]
    for sample in out.samples:
        check(sample if sample.prompt_logprobs else out.samples[0], PROMPT[:9], reference(PROMPT[:9]), 2)
    single = llm.generate([[1]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    assert single.prompt_logprobs == [None]


@pytest.mark.slow
def test_gpu_checks_engine_check_passes_on_the_cpu(default_model_dir):
    """gpu-check's knobs through the engine (client/tools/gpu_check/sampling.py), here: every check
    holds and the prefill's prompt logprobs equal the decode steps' logprobs to float32 rounding."""
    from client.tools.gpu_check.sampling import engine_check
    from client.tools.gpu_check.structured import SCHEMA
    res = engine_check(LLM(str(default_model_dir), max_num_seqs=4, max_model_len=256), SCHEMA, "cpu")
    assert res["ok"], res
    assert res["prompt_logprobs_gap"] < 1e-4


def test_prompt_logprobs_of_smollm2_equal_transformers():
    """SmolLM2-135M-Instruct (float32), a real tokenizer's text prompt, chunked at 11 tokens."""
    from transformers import AutoModelForCausalLM

    from smollm2 import smollm2_dir
    model_dir = smollm2_dir()
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=11,
              max_tokens_in_paged_kv_cache=4096)
    out = llm.generate(["The capital of France is Paris, and the capital of Italy is"],
                       SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=4))[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([out.prompt_token_ids])).logits[0].float(), dim=-1)
    assert len(out.prompt_token_ids) > 11
    for pos in range(1, len(out.prompt_token_ids)):
        entries, row, token = out.prompt_logprobs[pos], ref[pos - 1], out.prompt_token_ids[pos]
        assert set(entries) == set(row.topk(4).indices.tolist()) | {token}
        for tok, lp in entries.items():
            assert abs(lp.logprob - float(row[tok])) < 2e-3, (pos, tok)
        assert entries[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)


@pytest.mark.parametrize("chunk", [19, 18])
def test_prompt_logprobs_when_the_last_chunk_is_the_last_prompt_token_alone(default_model_dir, reference, chunk):
    """A 20-token prompt in chunks of 19 ends with a chunk of its last token alone, whose next token is
    not a prompt token: the logprobs the earlier chunks kept are still handed over with the first
    token (they were lost: [None] came back; the pacing's timing-dependent chunks met it in a loaded
    run). Chunks of 18 end with two tokens, the case that always worked."""
    llm = LLM(str(default_model_dir), max_num_seqs=4, max_model_len=128, max_num_batched_tokens=chunk,
              enable_chunked_context=True)
    out = llm.generate([PROMPT[:20]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    check(out, PROMPT[:20], reference(PROMPT[:20]), 1)
