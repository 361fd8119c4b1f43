"""The engine on quantized weights (docs/quantization.md): packed GGUF folders load as they are
(`quantization` auto/gguf), or dequantized (none); float checkpoints quantize at load (int8); the
results stay close to the same weights in float32, measured by teacher-forced log-probabilities
(client/tools/quality/perplexity.py); and what cannot be done is refused by name.
"""
import json
import logging

import pytest
import torch

from backend import LLM, SamplingParams
from backend.models.gguf.importer import import_gguf
from backend.models.make_model import make_model
from backend.models.float_linear import FloatLinear
from backend.models.packed_linear import PackedLinear
from backend.models.quant_linear import ConcatLinear, QuantEmbedding, QuantLinear, quantize_q8_0
from kernels.cpu import build as cpu_build
from kernels.cpu import quant as cpu_quant
from kernels.quant_reference import dequantize
from client.tools.quality.perplexity import window_logprobs
from gguf_files import ALL_TYPES, K_SHAPE, K_TYPES, write_gguf

QUIET = dict(log=lambda *_: None)
SMALL = dict(cpu_kv_cache_tokens=512, max_model_len=256)


@pytest.fixture(scope="module")
def tiny_tokenizer_json(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny")) / "tokenizer.json"


def packed_folder(tmp_path, tokenizer_json, **kwargs):
    path = tmp_path / "model.gguf"
    write_gguf(path, tokenizer_json, seed=11, **kwargs)
    return import_gguf(path, tmp_path / "packed", **QUIET)


def logprob_gap(a: LLM, b: LLM, ids) -> tuple[float, float]:
    """Mean and largest difference of the two engines' log-probabilities of each next token of
    ``ids``. Random tiny models, with their sharp logits, are touchy: quantizing the activations
    (as llama.cpp does) moves them by 0.1-0.4 on average, where a wrong scale, code or order
    moves them by several. The weights themselves are compared exactly; the real model's
    quality is tests/test_quant_quality.py's (perplexity within 1%)."""
    gap = (window_logprobs(a, ids) - window_logprobs(b, ids)).abs()
    return float(gap.mean()), float(gap.max())


def dequantized_rows(module) -> torch.Tensor:
    """Every row of a quantized projection's weight, dequantized by its kernel, [N, K]."""
    if isinstance(module, ConcatLinear):
        return torch.cat([dequantized_rows(p) for p in module.parts])
    return module.rows(torch.arange(module.out_features))


@pytest.mark.parametrize("types,shape,tied", [
    (ALL_TYPES[3:], None, True),  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 in turn; q/k/v of mixed types
    (K_TYPES, K_SHAPE, False),
    (("Q4_0",), None, True),  # one type: fused q/k/v and gate/up are single GEMMs
])
def test_packed_weights_run_as_they_are_and_match_their_float_form(tmp_path, tiny_tokenizer_json, types, shape, tied):
    folder = packed_folder(tmp_path, tiny_tokenizer_json, types=types, shape=shape, tied=tied)
    quant = LLM(str(folder), **SMALL)
    floats = LLM(str(folder), quantization="none", attention_backend="torch", **SMALL)  # plain nn.Linear
    runner = quant.engine.runner
    assert runner.weights.quantization == "gguf" and floats.engine.runner.weights.quantization == "none"
    # kv_cache_dtype auto: bfloat16 beside quantized weights on CPU, the dtype's beside float ones
    assert runner.kv_dtype == torch.bfloat16 and floats.engine.runner.kv_dtype == torch.float32
    model, reference = runner.model, floats.engine.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert (model.lm_head is model.embed_tokens.table) == tied  # a tied lm_head reads the same table
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ConcatLinear if len(types) > 1 else QuantLinear)
    assert all(isinstance(p, QuantLinear) for p in getattr(qkv, "parts", [qkv]))
    # Every projection holds exactly the dequantized float model's weights: fused in order, q/k
    # rows un-permuted, the embedding and lm_head where they belong.
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        for layer, ref_layer in zip(model.layers, reference.layers):
            assert torch.equal(dequantized_rows(layer.get_submodule(name)), ref_layer.get_submodule(name).weight), name
    assert torch.equal(dequantized_rows(model.lm_head), reference.lm_head.weight)
    ids_all = torch.arange(reference.embed_tokens.weight.shape[0])
    assert torch.equal(model.embed_tokens(ids_all), reference.embed_tokens.weight)
    assert runner.weights.weight_bytes < 0.4 * floats.engine.runner.weights.weight_bytes
    # End to end, the activations' rounding moves the log-probabilities a little (random tiny
    # models are touchy: ~0.1 on average), where a wrong scale or code moves them by several.
    ids = [int(i) for i in torch.randint(3, 1000, (60,), generator=torch.Generator().manual_seed(1))]
    mean, worst = logprob_gap(quant, floats, ids)
    assert mean < 0.5 and worst < 2.0, (mean, worst)
    out = quant.generate([ids[:20]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and quant.stats()["kv_blocks_used"] == 0


def test_int8_quantizes_a_float_checkpoint_at_load(tmp_path, default_model_dir, caplog):
    # every input a whole number of groups; tied, so the embedding reads the lm_head's table
    folder = make_model(tmp_path / "m", intermediate_size=704, tie_word_embeddings=True)
    int8 = LLM(str(folder), quantization="int8", **SMALL)
    floats = LLM(str(folder), attention_backend="torch", **SMALL)  # plain nn.Linear weights
    model, reference = int8.engine.runner.model, floats.engine.runner.model
    assert int8.engine.runner.weights.quantization == "int8"
    assert not any(isinstance(m, (torch.nn.Linear, PackedLinear)) for m in model.modules())
    assert model.embed_tokens.table is model.lm_head  # tied: one Q8_0 table
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, QuantLinear) and not name.startswith("embed_tokens"):
            assert module.qtype == "Q8_0"
            ref = reference.get_submodule(name).weight
            assert torch.equal(dequantized_rows(module), dequantize("Q8_0", quantize_q8_0(ref))), name
            assert float((dequantized_rows(module) - ref).abs().max()) <= float(ref.abs().max()) / 127
    mean, worst = logprob_gap(int8, floats, list(range(5, 65)))
    assert mean < 0.5 and worst < 2.0, (mean, worst)  # see logprob_gap
    assert int8.engine.runner.weights.weight_bytes < 0.35 * floats.engine.runner.weights.weight_bytes
    with caplog.at_level(logging.WARNING, logger="backend.models.quantize_at_load"):  # 688 inputs: kept float
        model = LLM(str(default_model_dir), quantization="int8", **SMALL).engine.runner.model
    assert "4 linear layer(s) kept float" in caplog.text
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)


def test_bf16_kv_cache_keeps_greedy_tokens(default_model_dir):
    bf16 = LLM(str(default_model_dir), kv_cache_dtype="bfloat16", **SMALL)
    assert bf16.engine.runner.kv_caches[0][0].dtype == torch.bfloat16 and bf16.engine.runner.ops.name == "cpu"
    f32 = LLM(str(default_model_dir), **SMALL)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5, 9, 14, 200, 31], list(range(40, 90))]
    a, b = bf16.generate(prompts, [greedy] * 2), f32.generate(prompts, [greedy] * 2)
    assert [o.token_ids[:4] for o in a] == [o.token_ids[:4] for o in b]
    # half the bytes per cached token
    assert bf16.engine.runner._bytes_per_block() * 2 == f32.engine.runner._bytes_per_block()


def test_what_cannot_be_done_is_refused_by_name(tmp_path, tiny_tokenizer_json, default_model_dir):
    folder = packed_folder(tmp_path, tiny_tokenizer_json, types=("Q8_0",))
    with pytest.raises(ValueError, match="quantization=gguf needs a checkpoint with packed GGUF weights"):
        LLM(str(default_model_dir), quantization="gguf", **SMALL)
    with pytest.raises(ValueError, match="quantization=int8 quantizes float weights; this checkpoint is already"):
        LLM(str(folder), quantization="int8", **SMALL)
    with pytest.raises(ValueError, match="quantization=fp8 needs a CUDA GPU"):
        LLM(str(default_model_dir), quantization="fp8", **SMALL)
    with pytest.raises(ValueError, match="kv_cache_dtype=fp8 needs a CUDA GPU with fp8 support"):
        LLM(str(default_model_dir), kv_cache_dtype="fp8", **SMALL)
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, int8, fp8; got 'int4'"):
        LLM(str(default_model_dir), quantization="int4")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["layout"] = "someone-else/9"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layout 'someone-else/9' is not one inflight reads"):
        LLM(str(folder), **SMALL)


def test_bf16_weights_run_bf16_gemms_beside_float32_activations(default_model_dir):
    bf16, f32 = LLM(str(default_model_dir), dtype="bfloat16", **SMALL), LLM(str(default_model_dir), **SMALL)
    runner = bf16.engine.runner
    assert runner.ops.name == "cpu" and runner.model.compute_dtype == torch.float32  # the C kernels
    # float_gemm.c's FloatLinears (issue 47), or oneDNN's PackedLinears: bf16 weights either way
    linears = [m for m in runner.model.modules() if isinstance(m, (PackedLinear, FloatLinear))]
    # (held as bfloat16: reordered for oneDNN's bf16 GEMM, or as it is where oneDNN has none (AVX2-only))
    assert linears and all((m.weight if isinstance(m, FloatLinear) else m.packed).dtype == torch.bfloat16
                           for m in linears)
    assert all(p.dtype == torch.float32 for p in runner.model.parameters() if p.dim() == 1)  # norms
    assert runner.weights.weight_bytes < 0.55 * f32.engine.runner.weights.weight_bytes
    mean, worst = logprob_gap(bf16, f32, list(range(5, 65)))
    assert mean < 0.1 and worst < 0.5, (mean, worst)


@pytest.mark.parametrize("types,shape", [(ALL_TYPES[3:], None), (K_TYPES, K_SHAPE)])
def test_greedy_tokens_are_the_same_with_the_avx2_build_forced(tmp_path, tiny_tokenizer_json, monkeypatch, types, shape):
    # INFLIGHT_CPU_ISA picks the build (kernels/cpu/quant.py); the portable C one runs on any CPU and
    # computes the same integer sums: the AVX2 and AVX-VNNI intrinsics (quant_gemm_avx2.h) must
    # give its tokens.
    flags = set(cpu_build._cpu_flags().split())
    builds = [b for b in ("avx2", "avx_vnni") if set(cpu_quant.NEEDS[b]) <= flags]
    if not builds:
        pytest.skip("this CPU does not list AVX2")
    folder = packed_folder(tmp_path, tiny_tokenizer_json, types=types, shape=shape, tied=False)
    prompts = [[5, 9, 14, 200, 31], list(range(40, 75))]  # a GEMV per step, then two rows
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for isa in ["portable"] + builds:
        monkeypatch.setenv("INFLIGHT_CPU_ISA", isa)
        cpu_quant.chosen_isa.cache_clear()
        llm = LLM(str(folder), quantization="gguf", **SMALL)  # auto could dequantize: cpu_weight_choice
        assert llm.engine.runner.model.layers[0].mlp.down_proj.kernel.isa == isa
        tokens[isa] = [o.token_ids for o in llm.generate(prompts, [greedy] * 2)]
    cpu_quant.chosen_isa.cache_clear()
    assert all(tokens[b] == tokens["portable"] for b in builds) and len(tokens) == len(builds) + 1
