"""`inflight import-gguf` on mixture-of-experts GGUF files (llama.cpp's stacked ffn_*_exps and
ffn_gate_inp), written with the gguf package from checkpoints transformers saved itself: a float
file imports to exactly the safetensors checkpoint (tensor for tensor, and the engine's tokens and
log-probabilities on both); a quantized one keeps its experts packed, stacked [E, ...], which the
engine runs one QuantLinear per expert, equal to the --dequantize import's weights and close to
its log-probabilities."""
import json

import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.models.gguf import importer
from backend.models.make_model import make_model
from backend.models.quant_linear import QuantLinear
from gguf_files import write_moe_gguf
from hf_checkpoints import make_checkpoint
from test_quantized_engine import dequantized_rows, logprob_gap

SMALL = dict(cpu_kv_cache_tokens=512, max_model_len=128)
PROMPTS = [[5, 77, 1500, 42], list(range(300, 337)), [9]]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tok")) / "tokenizer.json"


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=4, vocab_size=2000)


def generate(path, **kwargs):
    llm = LLM(str(path), **SMALL, **kwargs)
    return llm, llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0))


def test_a_float_gguf_imports_to_the_safetensors_checkpoint(checkpoint, tokenizer_json, tmp_path):
    write_moe_gguf(tmp_path / "moe.gguf", tokenizer_json, checkpoint)
    assert importer.main([str(tmp_path / "moe.gguf"), "--out", str(tmp_path / "out")]) == 0   # inflight import-gguf
    ours, theirs = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(checkpoint / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    config, original = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "out", checkpoint))
    experts = [c.get("num_experts") or c.get("num_local_experts") for c in (config, original)]   # either name
    assert experts[0] == experts[1] == 8
    for key in ("architectures", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                "intermediate_size", "head_dim"):
        if original.get(key) is not None:
            assert config[key] == original[key], key
    _, want = generate(checkpoint)
    _, got = generate(tmp_path / "out")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.cumulative_logprob for o in got] == [o.cumulative_logprob for o in want]


@pytest.mark.parametrize("types", [("Q8_0", "Q4_0", "Q5_1"),   # gate and up of different types: two GEMMs
                                   ("Q4_1",)])                  # one type: gate and up fused into one
def test_a_quantized_gguf_keeps_its_experts_packed(checkpoint, tokenizer_json, tmp_path, types):
    write_moe_gguf(tmp_path / "moe.gguf", tokenizer_json, checkpoint, types=types)
    packed = importer.import_gguf(tmp_path / "moe.gguf", tmp_path / "packed", log=lambda *_: None)
    floats = importer.import_gguf(tmp_path / "moe.gguf", tmp_path / "floats", dequantize=True, log=lambda *_: None)
    modules = json.loads((packed / "config.json").read_text())["quantization_config"]["modules"]
    stacked = {n: t for n, t in modules.items() if ".experts." in n}
    assert stacked and all(n.split(".experts.")[1] in ("w1", "w3", "w2", "gate_proj", "up_proj", "down_proj")
                           for n in stacked)                                   # stacked: no expert index
    quant, _ = generate(packed)
    reference, _ = generate(floats, attention_backend="torch")
    deq = load_file(str(floats / "model.safetensors"))
    model = quant.engine.runner.model
    layer = next(i for i, l in enumerate(model.layers) if hasattr(l.mlp, "experts"))
    experts = model.layers[layer].mlp.experts
    block = "block_sparse_moe" if "w1" in " ".join(stacked) else "mlp"
    gate, up, down = ("w1", "w3", "w2") if block == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
    assert isinstance(experts.gate_up[0], QuantLinear) == (len(types) == 1)
    # one type: every active expert in one int8 C call per projection; mixed: one GEMM pair per expert
    assert (experts.quant_experts is not None) == (len(types) == 1)
    for e in range(experts.num_experts):
        assert isinstance(experts.down[e], QuantLinear)
        base = f"model.layers.{layer}.{block}.experts.{e}."
        want = torch.cat([deq[base + f"{gate}.weight"], deq[base + f"{up}.weight"]])
        assert torch.equal(dequantized_rows(experts.gate_up[e]), want)
        assert torch.equal(dequantized_rows(experts.down[e]), deq[base + f"{down}.weight"])
    mean, worst = logprob_gap(quant, reference, list(range(5, 45)))
    assert mean < 0.5 and worst < 2.0, (mean, worst)   # activations quantized per 32, as llama.cpp
    assert quant.engine.runner.weights.weight_bytes < 0.45 * reference.engine.runner.weights.weight_bytes
