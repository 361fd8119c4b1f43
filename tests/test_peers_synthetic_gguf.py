"""The peer table's synthetic GGUF files (client/tools/peers/synthetic_gguf.py), tiny versions of each
shape: the tensor names, shapes and keys llama.cpp's qwen3 / qwen3moe loaders ask for (llama.cpp
src/models/qwen3.cpp, qwen3moe.cpp: create_tensor's names and ggml shapes), the tokenizer copied whole,
Q4_K blocks drawn directly that gguf-py and inflight's import read as the same values; `inflight
import-gguf` loads each and the engine generates; the F16 / BF16 copy holds the source's values."""
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.models.gguf.importer import import_gguf
from backend.models.loader import load_model_config
from client.tools.peers import synthetic_gguf as sg
from gguf_files import write_gguf

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("tok") / "tok.gguf"
    write_gguf(path, default_model_dir / "tokenizer.json", types=("Q4_1", "Q8_0"))
    return path


def llama_cpp_tensors(s: sg.Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """What llama.cpp's loader creates for ``s``, in ggml order (innermost first), tied output."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    want = {"token_embd.weight": (s.hidden, vocab), "output_norm.weight": (s.hidden,)}
    for i in range(s.layers):
        b = f"blk.{i}."
        want.update({b + "attn_norm.weight": (s.hidden,), b + "attn_q.weight": (s.hidden, q),
                     b + "attn_k.weight": (s.hidden, kv), b + "attn_v.weight": (s.hidden, kv),
                     b + "attn_output.weight": (q, s.hidden), b + "attn_k_norm.weight": (s.head_dim,),
                     b + "attn_q_norm.weight": (s.head_dim,), b + "ffn_norm.weight": (s.hidden,)})
        if s.experts:
            want.update({b + "ffn_gate_inp.weight": (s.hidden, s.experts),
                         b + "ffn_gate_exps.weight": (s.hidden, s.expert_ffn, s.experts),
                         b + "ffn_down_exps.weight": (s.expert_ffn, s.hidden, s.experts),
                         b + "ffn_up_exps.weight": (s.hidden, s.expert_ffn, s.experts)})
        else:
            want.update({b + "ffn_gate.weight": (s.hidden, s.ffn), b + "ffn_down.weight": (s.ffn, s.hidden),
                         b + "ffn_up.weight": (s.hidden, s.ffn)})
    return want


CASES = [(sg.TINY_QWEN3, "Q8_0"), (sg.TINY_QWEN3, "Q4_K"), (sg.TINY_QWEN3_MOE, "Q8_0"), (sg.TINY_QWEN3_MOE, "Q4_K")]


@pytest.mark.parametrize("shape,qtype", CASES, ids=[f"{s.arch}-{q}" for s, q in CASES])
def test_a_synthetic_file_is_what_llama_cpp_loads_and_inflight_serves(shape, qtype, tokenizer_gguf, tmp_path):
    path = sg.write_synthetic(tmp_path / "m.gguf", shape, qtype, tokenizer_gguf, seed=3)
    reader, source = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(tokenizer_gguf))
    tokens = source.fields["tokenizer.ggml.tokens"].contents()
    assert {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors} == llama_cpp_tensors(shape, len(tokens))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {v for k, v in types.items() if "norm" not in k and "gate_inp" not in k} == {qtype}
    assert all(types[k] == "F32" for k in types if "norm" in k or "gate_inp" in k)
    field = lambda name: reader.fields[name].contents()  # noqa: E731
    assert field("general.architecture") == shape.arch
    a = shape.arch
    assert (field(f"{a}.block_count"), field(f"{a}.embedding_length"), field(f"{a}.attention.head_count"),
            field(f"{a}.attention.head_count_kv"), field(f"{a}.attention.key_length"),
            field(f"{a}.attention.value_length")) == (shape.layers, shape.hidden, shape.heads, shape.kv_heads,
                                                      shape.head_dim, shape.head_dim)
    if shape.experts:
        assert (field(f"{a}.expert_count"), field(f"{a}.expert_used_count"),
                field(f"{a}.expert_feed_forward_length")) == (shape.experts, shape.experts_used, shape.expert_ffn)
    for name, f in source.fields.items():  # the tokenizer whole, with its types
        if name.startswith("tokenizer."):
            assert reader.fields[name].contents() == f.contents() and reader.fields[name].types == f.types, name
    out = import_gguf(path, tmp_path / "out", **QUIET)  # `inflight import-gguf`
    cfg = load_model_config(out)
    assert cfg.architecture == {"qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}[a]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, len(tokens))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] and config["tie_word_embeddings"]
    if shape.experts:
        assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (
            shape.experts, shape.experts_used, shape.expert_ffn)
    llm = LLM(str(out), max_model_len=128, cpu_kv_cache_tokens=512)
    outs = llm.generate([[5, 77, 1500, 42], list(range(300, 337))],
                        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [7, 7]


def test_random_q4_k_blocks_read_alike_in_gguf_py_and_inflight(tokenizer_gguf, tmp_path):
    """The Q4_K fallback's bytes (gguf-py has no Q4_K quantizer): zero-mean values of std ~1/sqrt(K)
    as gguf-py dequantizes them, and inflight's --dequantize import reads the same floats."""
    path = sg.write_synthetic(tmp_path / "m.gguf", sg.TINY_QWEN3, "Q4_K", tokenizer_gguf, seed=5)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    down = tensors["blk.1.ffn_down.weight"]
    values = gguf.quants.dequantize(down.data, down.tensor_type)
    assert values.shape == (256, 512)
    assert abs(values.mean()) < 0.002 and 0.8 < values.std() * np.sqrt(512) < 1.25
    assert len(np.unique(values[0, :32])) > 8  # the codes vary within a group
    out = import_gguf(path, tmp_path / "out", dequantize=True, **QUIET)
    weights = load_file(str(out / "model.safetensors"))
    assert torch.equal(weights["model.layers.1.mlp.down_proj.weight"], torch.from_numpy(values))
    gate = tensors["blk.0.ffn_gate.weight"]
    assert torch.equal(weights["model.layers.0.mlp.gate_proj.weight"],
                       torch.from_numpy(gguf.quants.dequantize(gate.data, gate.tensor_type)))
    with pytest.raises(ValueError, match="256-value super-blocks; this matrix's rows are 100"):
        sg.random_q4_k(np.random.default_rng(0), 4, 100)


def test_the_same_seed_writes_the_same_file(tokenizer_gguf, tmp_path):
    a = sg.write_synthetic(tmp_path / "a.gguf", sg.TINY_QWEN3_MOE, "Q8_0", tokenizer_gguf, seed=2)
    b = sg.write_synthetic(tmp_path / "b.gguf", sg.TINY_QWEN3_MOE, "Q8_0", tokenizer_gguf, seed=2)
    c = sg.write_synthetic(tmp_path / "c.gguf", sg.TINY_QWEN3_MOE, "Q8_0", tokenizer_gguf, seed=3)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("ftype", ["F16", "BF16"])
def test_a_float_copy_holds_the_quantized_files_values(ftype, tokenizer_gguf, tmp_path):
    path = sg.write_float_copy(tmp_path / "f.gguf", tokenizer_gguf, ftype)
    src = {t.name: t for t in gguf.GGUFReader(str(tokenizer_gguf)).tensors}
    reader = gguf.GGUFReader(str(path))
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[ftype]
    for t in reader.tensors:
        s = src[t.name]
        assert tuple(t.shape) == tuple(s.shape), t.name
        if len(s.shape) == 1:
            assert t.tensor_type.name == "F32" and np.array_equal(t.data, s.data)
            continue
        assert t.tensor_type.name == ftype, t.name
        want = torch.from_numpy(gguf.quants.dequantize(s.data, s.tensor_type)).to(dtype).float()
        assert torch.equal(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)), want), t.name
    src_fields = gguf.GGUFReader(str(tokenizer_gguf)).fields
    for name, f in src_fields.items():
        if not name.startswith("GGUF.") and name != "general.file_type":
            assert reader.fields[name].contents() == f.contents(), name
    assert reader.fields["general.file_type"].contents() == sg.FILE_TYPES[ftype]
    out = import_gguf(path, tmp_path / "out", **QUIET)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == {"F16": "float16", "BF16": "bfloat16"}[ftype]
    llm = LLM(str(out), max_model_len=128, cpu_kv_cache_tokens=512)
    outs = llm.generate([[5, 77, 1500, 42]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(outs[0].token_ids) == 5
