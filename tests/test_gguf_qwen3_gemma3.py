"""`inflight import-gguf` on Qwen3 and Gemma 3 files: a transformers checkpoint converted to GGUF the
way llama.cpp's converter does (tests/gguf_files.py: its names and keys, Gemma's norms stored as
1 + w, no q/k permutation) comes back as the same checkpoint: the same configuration as the engine
reads it, the same tensors (float32 files: bit for bit; transformers' own GGUF loader agrees), the
same greedy tokens; quantized matrices stay packed and serve."""
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.models.gguf.importer import GGUFImportError, import_gguf
from backend.models.loader import load_model_config
from gguf_files import finish, tokenizer_metadata, write_gguf_from_hf
from hf_checkpoints import hf_greedy, make_checkpoint
from kernels.quant_reference import ARRAYS, dequantize

QUIET = dict(log=lambda *_: None)
# What llama.cpp's gemma3 assumes and so a GGUF cannot say otherwise: a global layer after every
# five local ones, the local RoPE base 10,000, the attention scale 1/sqrt(head_dim).
GEMMA3_AS_LLAMA_CPP = dict(num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=32)


@pytest.fixture(scope="module")
def tokenizer_json(default_model_dir):
    return default_model_dir / "tokenizer.json"   # the embedded default model's byte-level BPE


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def converted(request, tmp_path_factory, tokenizer_json):
    """(arch, the transformers checkpoint, its float32 GGUF file, the import of that file)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"gguf-{arch}")
    vocab = len(tokenizer_metadata(tokenizer_json)[0])
    hf_dir = make_checkpoint(arch, root / "hf", seed=9, vocab_size=vocab,
                             **(GEMMA3_AS_LLAMA_CPP if arch == "gemma3" else {}))
    path = root / f"{arch}.gguf"
    assert write_gguf_from_hf(path, hf_dir, tokenizer_json) == arch
    return arch, hf_dir, path, import_gguf(path, root / "out", **QUIET)  # what `inflight import-gguf` runs


def test_the_configuration_is_the_checkpoints(converted):
    arch, hf_dir, _, out = converted
    ours, theirs = load_model_config(out), load_model_config(hf_dir)
    assert ours.architecture == theirs.architecture == {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta", "rope_scaling", "tie_word_embeddings", "qkv_bias", "o_bias",
                  "layer_windows", "local_rope_theta", "local_rope_scaling", "qk_norm", "activation",
                  "norm_weight_offset", "sandwich_norms", "embedding_scale", "attention_scale",
                  "final_logit_softcapping", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    if arch == "gemma3":
        assert ours.layer_windows == (13, 13, 13, 13, 13, 0) and ours.rope_scaling["rope_type"] == "linear"
        assert ours.final_logit_softcapping == 30.0


def test_the_tensors_are_the_checkpoints_and_transformers_reads_the_file_alike(converted):
    """F32 files: every tensor bit for bit, but Gemma's norms: the converter stored fl(1 + w), which
    keeps fewer of w's bits, and the import takes the 1 off again, so 1 + w (what the engine
    multiplies by) is the checkpoint's bit for bit, and w is within float32's step at 1.
    transformers' GGUF loader reads Gemma 3 files to the same tensors; its qwen3 mapping ignores
    attention.key_length (it sizes heads as hidden / heads), so it cannot read this Qwen3's head_dim
    of 32 beside hidden 64 / 4 heads, as Qwen3-0.6B's 128 beside 1024 / 16."""
    from transformers import AutoModelForCausalLM
    arch, hf_dir, path, out = converted
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(hf_dir / "model.safetensors"))
    assert set(ours) == set(theirs)
    shift = 1.0 if arch == "gemma3" else 0.0
    norms = [n for n in theirs if n.endswith("norm.weight")]
    assert norms and all(torch.equal(ours[n] + shift, theirs[n].float() + shift) for n in norms)
    differ = [n for n in theirs if n not in norms and not torch.equal(ours[n], theirs[n].float())]
    assert not differ, differ
    if arch == "qwen3":
        return
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(state) == set(ours) and all(torch.equal(state[k], ours[k]) for k in ours)


def test_the_import_serves_the_checkpoints_greedy_tokens(converted):
    arch, hf_dir, _, out = converted
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (5, 14, 40)]   # up to three windows
    expected = hf_greedy(hf_dir, prompts, [6, 6, 6])
    params = SamplingParams(max_tokens=6, temperature=0)
    for folder in (out, hf_dir):
        assert [o.token_ids for o in LLM(str(folder), kv_block_size=16).generate(prompts, params)] == expected


def test_quantized_matrices_stay_packed_and_serve(converted, tmp_path, tokenizer_json):
    arch, hf_dir, _, _ = converted
    path = tmp_path / "q.gguf"
    write_gguf_from_hf(path, hf_dir, tokenizer_json, types=("Q8_0", "Q4_0", "Q5_1"))
    packed = import_gguf(path, tmp_path / "packed", **QUIET)
    floats = load_file(str(import_gguf(path, tmp_path / "float", dequantize=True, **QUIET) / "model.safetensors"))
    config = json.loads((packed / "config.json").read_text())
    modules = config["quantization_config"]["modules"]
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    tied = load_model_config(hf_dir).tie_word_embeddings
    assert {m.rsplit(".", 1)[-1] for m in modules} == set(projections) | {"embed_tokens"} | (set() if tied else {"lm_head"})
    tensors = load_file(str(packed / "model.safetensors"))
    for module, qtype in modules.items():
        arrays = {k.rsplit(".", 1)[-1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
        assert set(arrays) == set(ARRAYS[qtype]) and torch.equal(dequantize(qtype, arrays), floats[module + ".weight"])
    assert torch.equal(tensors["model.layers.0.self_attn.q_norm.weight"], floats["model.layers.0.self_attn.q_norm.weight"])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    prompt = [[5, 9, 200, 31, 7, 1200, 44, 18, 3, 600, 70, 8, 90, 11, 500]]
    llm = LLM(str(packed), kv_block_size=16)
    assert llm.engine.runner.weights.quantization == "gguf"
    got = llm.generate(prompt, params)[0]
    want = LLM(str(tmp_path / "float"), kv_block_size=16).generate(prompt, params)[0]
    assert got.finish_reason == "length"
    shared = set(got.logprobs[0]) & set(want.logprobs[0])   # int8 activations (as llama.cpp) move them a little
    assert shared and all(abs(got.logprobs[0][t].logprob - want.logprobs[0][t].logprob) < 0.1 for t in shared)


def test_gemma3_files_may_set_their_pattern_and_local_base(tmp_path, tokenizer_json):
    """A file that states its sliding-window pattern (a period, or a flag per layer) and its local
    RoPE base keeps them; attention soft-capping is refused by name."""
    import gguf
    hf_dir = make_checkpoint("gemma3", tmp_path / "hf", vocab_size=len(tokenizer_metadata(tokenizer_json)[0]),
                             **GEMMA3_AS_LLAMA_CPP)
    base = tmp_path / "base.gguf"
    write_gguf_from_hf(base, hf_dir, tokenizer_json)
    reader = gguf.GGUFReader(str(base))

    def variant(name, **keys):
        path = tmp_path / f"{name}.gguf"
        writer = gguf.GGUFWriter(str(path), "gemma3")
        for field in reader.fields.values():
            if field.name.startswith(("GGUF.", "general.architecture")):
                continue
            value = field.contents()
            writer.add_key_value(field.name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
        for key, (value, vtype) in keys.items():
            writer.add_key_value(key, value, vtype)
        for t in reader.tensors:
            writer.add_tensor(t.name, t.data)
        finish(writer)
        return path

    V = gguf.GGUFValueType
    period = variant("period", **{"gemma3.attention.sliding_window_pattern": (3, V.UINT32),
                                  "gemma3.rope.freq_base_swa": (20000.0, V.FLOAT32)})
    cfg = load_model_config(import_gguf(period, tmp_path / "period", **QUIET))
    assert cfg.layer_windows == (13, 13, 0, 13, 13, 0) and cfg.local_rope_theta == 20000.0
    flags = variant("flags", **{"gemma3.attention.sliding_window_pattern": ([True, False] * 3, V.ARRAY)})
    assert load_model_config(import_gguf(flags, tmp_path / "flags", **QUIET)).layer_windows == (13, 0) * 3
    capped = variant("capped", **{"gemma3.attn_logit_softcapping": (50.0, V.FLOAT32)})
    with pytest.raises(GGUFImportError, match="attn_logit_softcapping"):
        import_gguf(capped, tmp_path / "capped", **QUIET)
