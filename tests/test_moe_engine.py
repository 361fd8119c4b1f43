"""Mixtral and Qwen3-MoE (backend/models/moe.py) against transformers on random-weight checkpoints
it wrote itself (tests/hf_checkpoints.py): greedy tokens equal and log-probabilities close, with
prefill whole and in chunks, through every expert path the engine has (the CPU's oneDNN-packed
experts one GEMM per active expert, the torch reference, the fused-MoE Triton kernel under the
interpreter with decode steps through the CUDA-graph static buffers)."""
from __future__ import annotations

import random

import pytest
import torch

from backend import LLM, SamplingParams
from backend.models.moe import SparseMoeBlock
from backend.models.packed_linear import PackedLinear
from hf_checkpoints import make_checkpoint

BLOCK = 16


def workload(seed: int = 0):
    rng = random.Random(seed)
    lens = [1, BLOCK, 2 * BLOCK + 1] + [rng.randint(2, 70) for _ in range(5)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lens]
    return prompts, [rng.randint(1, 10) for _ in lens]


def hf_tokens_and_logprobs(path, prompts, max_tokens):
    """transformers' greedy continuation (float32, CPU) and each chosen token's log-probability."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 num_beams=1, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            new = out.sequences[0, len(prompt):].tolist()
            tokens.append(new)
            logprobs.append([torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new)])
    return tokens, logprobs


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def oracle(request, tmp_path_factory):
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    prompts, max_tokens = workload()
    return request.param, path, prompts, max_tokens, hf_tokens_and_logprobs(path, prompts, max_tokens)


@pytest.mark.parametrize("backend,chunked", [("auto", False), ("auto", True), ("torch", True),
                                            pytest.param("triton", True, marks=pytest.mark.slow)])
def test_greedy_tokens_and_logprobs_match_transformers(oracle, backend, chunked):
    arch, path, prompts, max_tokens, (expected, expected_logprobs) = oracle
    llm = LLM(str(path), attention_backend=backend, kv_block_size=BLOCK, max_model_len=256,
              enable_chunked_context=chunked, max_num_batched_tokens=24 if chunked else 512)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, logprobs=0) for n in max_tokens])
    assert [o.token_ids for o in outputs] == expected
    for out, want in zip(outputs, expected_logprobs):
        got = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        assert got == pytest.approx(want, abs=2e-4)
    runner = llm.engine.runner
    blocks = [layer.mlp for layer in runner.model.layers]
    moe_layers = [i for i, b in enumerate(blocks) if isinstance(b, SparseMoeBlock)]
    assert moe_layers == ([0, 1] if arch == "mixtral" else [0, 2])     # Qwen3-MoE's mlp_only_layers: [1]
    experts = blocks[0].experts
    if runner.ops.name == "cpu":   # one oneDNN-packed GEMM per expert, only those with tokens run
        assert isinstance(experts.gate_up[0], PackedLinear) and not hasattr(experts, "w13")
    else:                          # stacked for ops.fused_moe: the reference, or the Triton kernel
        assert experts.gate_up is None and experts.w13.shape == (8, 2 * experts.intermediate, 64)
    if backend == "triton":        # decode steps ran through the graphs' static buffers
        assert runner.graphs is not None and runner.graphs.replays > 0
    assert llm.stats()["kv_blocks_used"] == 0
    llm.check_integrity()
