"""Mixtral and Qwen3-MoE (backend/models/moe.py) against transformers on random-weight checkpoints
it wrote itself (tests/hf_checkpoints.py): greedy tokens equal and log-probabilities close, with
prefill whole and in chunks, through every expert path the engine has (the CPU's C kernel on the
experts laid out in its panels, every active expert in one call per projection; the torch
reference; the fused-MoE Triton kernel under the interpreter, on Mixtral, with decode steps
through the CUDA-graph static buffers)."""
from __future__ import annotations

import random

import pytest
import torch

from backend import LLM, SamplingParams
from backend.models.moe import SparseMoeBlock
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


@pytest.mark.parametrize("backend,chunked", [("auto", False), ("auto", True), ("torch", True)])
def test_greedy_tokens_and_logprobs_match_transformers(oracle, backend, chunked):
    match_transformers(oracle, backend, chunked)


@pytest.mark.slow
@pytest.mark.parametrize("oracle", ["mixtral"], indirect=True)
def test_the_triton_path_matches_transformers_on_mixtral(oracle):
    """The fused-MoE Triton kernel under the interpreter. The router runs before it (backend/models/
    moe.py's route), the same for both architectures, so the kernel sees one kind of input: Mixtral's
    run shows it; Qwen3-MoE's attention under Triton is tests/test_qwen3_gemma3.py's."""
    match_transformers(oracle, "triton", True)


def match_transformers(oracle, backend, chunked):
    arch, path, prompts, max_tokens, (expected, expected_logprobs) = oracle
    if backend == "triton":   # the interpreter runs every launch in Python: a few prompts do
        prompts, max_tokens, expected, expected_logprobs = (x[:4] for x in (prompts, max_tokens, expected,
                                                                            expected_logprobs))
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
    if runner.ops.name == "cpu":   # the C kernel's panels (kernels/cpu/moe.py), only experts with tokens run
        assert experts.w13_panels is not None and experts.gate_up is None and not hasattr(experts, "w13")
    else:                          # stacked for ops.fused_moe: the reference, or the Triton kernel
        assert experts.gate_up is None and experts.w13.shape == (8, 2 * experts.intermediate, 64)
    if backend == "triton":        # decode steps ran through the graphs' static buffers
        assert runner.decode_path.graphs is not None and runner.decode_path.graphs.replays > 0
    # every computed token (the prompt, each output fed back) went to top_k experts per MoE layer;
    # the rows steps are padded with (oneDNN's buckets, graph sizes) did not count
    computed = sum(len(p) + len(o.token_ids) - 1 for p, o in zip(prompts, outputs))
    assert sum(llm.stats()["moe_expert_tokens"]) == computed * 2 * len(moe_layers)
    assert llm.stats()["kv_blocks_used"] == 0
    llm.check_integrity()


@pytest.mark.slow
def test_lora_reaches_a_moe_models_attention_and_refuses_its_experts(tmp_path):
    """An adapter on Qwen3-MoE's attention equals PEFT's merged model; one that PEFT wrote for the
    experts, or one on the MLP of a layer whose MLP is experts, is refused by name."""
    from safetensors.torch import load_file, save_file

    from backend import LoRARequest
    from backend.models.lora.peft_format import load_adapter
    from backend.models.loader import load_model_config
    from lora_adapters import AdapterSpec, make_adapter, merged_oracle

    base = make_checkpoint("qwen3_moe", tmp_path / "base", seed=5)
    adapter = make_adapter(base, tmp_path / "a", seed=1, spec=AdapterSpec(targets=("q_proj", "v_proj", "o_proj"), b_std=0.1))
    prompts, names = workload(1)[0][2:6], ["a", None, "a", "a"]
    want = merged_oracle(base, {"a": adapter}, prompts, names, 6)
    llm = LLM(str(base), enable_lora=True, lora_modules=f"a={adapter}", max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0),
                        lora_request=[LoRARequest(n) if n else None for n in names])
    assert [o.token_ids for o in outs] == want
    assert want[0] != merged_oracle(base, {}, prompts[:1], [None], 6)[0]   # the adapter changes the tokens
    cfg = load_model_config(base)
    experts = make_adapter(base, tmp_path / "e", seed=2, spec=AdapterSpec(targets=("gate_proj", "up_proj", "down_proj")))
    # PEFT reaches fused expert weights through target_parameters
    with pytest.raises(ValueError, match=r"LoRA adapter 'e' \(.*\): target_parameters is not supported"):
        load_adapter("e", str(experts), cfg, 16)
    moved = tmp_path / "moved"   # a dense MLP's adapter, named for layer 0 (experts)
    moved.mkdir()
    (moved / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    save_file({k.replace("layers.0.self_attn.o_proj", "layers.0.mlp.down_proj"): v
               for k, v in load_file(str(adapter / "adapter_model.safetensors")).items() if "layers.0.self_attn.o_proj" in k},
              str(moved / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"layer 0's MLP is a mixture of experts"):
        load_adapter("m", str(moved), cfg, 16)


def test_int8_quantizes_each_expert_and_keeps_the_router_float(tmp_path):
    """quantization=int8 on Mixtral: every expert one Q8_0 QuantLinear of exactly its float weights'
    Q8_0 codes, the router a float GEMM (rounding it would move tokens between experts), the
    log-probabilities close to float32's; fp8 is refused by name (its GPU kernel reads no experts)."""
    from backend.models.float_linear import FloatLinear
    from backend.models.packed_linear import PackedLinear
    from backend.models.quant_linear import QuantLinear, quantize_q8_0
    from kernels.quant_reference import dequantize
    from test_quantized_engine import dequantized_rows, logprob_gap

    path = make_checkpoint("mixtral", tmp_path / "m", seed=7)
    int8 = LLM(str(path), quantization="int8", max_model_len=128)
    floats = LLM(str(path), attention_backend="torch", max_model_len=128)
    block, reference = int8.engine.runner.model.layers[1].mlp, floats.engine.runner.model.layers[1].mlp
    assert isinstance(block.gate, (PackedLinear, FloatLinear))  # a float GEMM (float_gemm.c since issue 47)
    assert block.experts.quant_experts is not None   # every active expert in one int8 C call per projection
    for e in range(8):
        assert isinstance(block.experts.gate_up[e], QuantLinear) and block.experts.gate_up[e].qtype == "Q8_0"
        want = dequantize("Q8_0", quantize_q8_0(reference.experts.w13[e]))
        assert torch.equal(dequantized_rows(block.experts.gate_up[e]), want)
    mean, worst = logprob_gap(int8, floats, list(range(5, 45)))
    assert mean < 0.5 and worst < 2.0, (mean, worst)
    with pytest.raises(ValueError, match="quantization=fp8 does not cover mixture-of-experts layers"):
        LLM(str(path), quantization="fp8")
