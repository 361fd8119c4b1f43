"""`inflight import-gguf` against transformers' own GGUF loader (an oracle we did not write):
tensor for tensor on small random GGUF files written with the gguf package's writer (every
supported type; Llama, Mistral, Qwen2) and on SmolLM2-135M-Instruct (Q4_1 + Q8_0); the tokenizer
rebuilt from the metadata tokenizes like transformers' GGUF tokenizer; unsupported files are
refused with messages naming what is unsupported.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from backend.models.gguf.packed import supported_types
from backend.models.gguf.importer import GGUFImportError, import_gguf
from backend.models.loader import load_model_config
from backend.models.make_model import make_model
from backend.text.tokenizer import Tokenizer
from gguf_files import (ALL_TYPES, CHAT_TEMPLATE, K_SHAPE, K_TYPES, SHAPE, llama_cpp_rope_factors,
                        write_gguf, write_sentencepiece_gguf)
from smollm2 import smollm2_dir, smollm2_gguf

TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnew lines  ", "Ünïcödé → 日本語のテキスト 🎉",
         "numbers 1234567 and 3.14159", "<s>special</s> tokens inside <s>", "don't you're I'll",
         "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def tiny_tokenizer_json(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny")) / "tokenizer.json"


def hf_from_gguf(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32)


def hf_tokenizer_from_gguf(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_tensors(ours: dict, hf_model, tied: bool):
    theirs = hf_model.state_dict()
    expected = set(theirs) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, theirs[name]), f"{name} differs from transformers' GGUF loader"


@pytest.mark.parametrize("arch,name,tied,pre", [
    ("llama", None, True, "smollm"),
    ("llama", "Mistral 7B tiny", False, "llama-bpe"),  # llama.cpp writes Mistral as "llama"
    ("qwen2", None, False, "qwen2"),
])
def test_random_gguf_matches_transformers(tmp_path, tiny_tokenizer_json, arch, name, tied, pre):
    path = tmp_path / "model.gguf"
    original = write_gguf(path, tiny_tokenizer_json, arch=arch, seed=3, name=name, tied=tied, pre=pre)
    out = import_gguf(path, tmp_path / "out", dequantize=True, log=lambda *_: None)
    ours = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if name:  # transformers 5.24 cannot load Mistral GGUFs (gguf-py has no "mistral" arch), so
        # its oracle is the same file without the name, which it reads as Llama: same tensors.
        assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] is None
        path = tmp_path / "unnamed.gguf"
        write_gguf(path, tiny_tokenizer_json, arch=arch, seed=3, tied=tied, pre=pre)
    hf = hf_from_gguf(path)
    assert_same_tensors(ours, hf, tied)
    if not name:
        assert config["architectures"] == [type(hf).__name__]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert config[key] == getattr(hf.config, key), key
    # Independently of transformers: F32 tensors come back exactly as written, q/k included (so the
    # row permutation is undone), and quantized ones within their quantization error.
    for hf_name, w in original.items():
        got = ours[hf_name].numpy()
        assert got.shape == w.shape, hf_name
        assert np.abs(got - w).max() <= 0.1 * np.abs(w).max() + 1e-6, hf_name
    exact = [n for n in original if n.endswith("norm.weight") or n.endswith(".bias")]
    assert exact and all(np.array_equal(ours[n].numpy(), original[n]) for n in exact)
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert np.corrcoef(ours[q0].numpy().ravel(), original[q0].ravel())[0, 1] > 0.98


def test_large_models_are_written_in_shards_with_an_index(tmp_path, tiny_tokenizer_json, monkeypatch):
    import backend.models.gguf.tensors as gi
    from backend.models.loader import iter_weights
    path = tmp_path / "model.gguf"
    write_gguf(path, tiny_tokenizer_json, types=("Q8_0",))
    whole = load_file(str(import_gguf(path, tmp_path / "whole", dequantize=True, log=lambda *_: None) / "model.safetensors"))
    monkeypatch.setattr(gi, "SHARD_BYTES", 200_000)  # the embedding alone is 2000 x 64 x 4 bytes
    out = import_gguf(path, tmp_path / "sharded", dequantize=True, log=lambda *_: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    loaded = dict(iter_weights(out))  # what the engine's loader reads
    assert set(loaded) == set(whole) and all(torch.equal(loaded[k], whole[k]) for k in whole)


def test_k_quant_gguf_matches_transformers(tmp_path, tiny_tokenizer_json):
    path = tmp_path / "k.gguf"
    original = write_gguf(path, tiny_tokenizer_json, types=K_TYPES + ("Q8_0",), shape=K_SHAPE, tied=False)
    out = import_gguf(path, tmp_path / "out", dequantize=True, log=lambda *_: None)
    ours = load_file(str(out / "model.safetensors"))
    assert_same_tensors(ours, hf_from_gguf(path), tied=False)
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert np.corrcoef(ours[q0].numpy().ravel(), original[q0].ravel())[0, 1] > 0.98


def test_random_gguf_covers_every_supported_type(tmp_path, tiny_tokenizer_json):
    import gguf
    written = set()
    for name, kwargs in (("small", {}), ("k", {"types": K_TYPES, "shape": K_SHAPE})):
        write_gguf(tmp_path / f"{name}.gguf", tiny_tokenizer_json, **kwargs)
        written |= {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / f"{name}.gguf")).tensors}
    assert written == set(ALL_TYPES + K_TYPES) == set(supported_types())


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2"])
def test_tokenizer_matches_transformers_gguf_tokenizer(tmp_path, tiny_tokenizer_json, pre):
    path = tmp_path / "model.gguf"
    write_gguf(path, tiny_tokenizer_json, pre=pre, types=("F16",))
    out = import_gguf(path, tmp_path / "out", log=lambda *_: None)
    ours, theirs = Tokenizer.from_dir(out), hf_tokenizer_from_gguf(path)
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert ours.chat_template == CHAT_TEMPLATE


def test_sentencepiece_tokenizer_matches_transformers(tmp_path, tiny_tokenizer_json):
    path = tmp_path / "spm.gguf"
    write_sentencepiece_gguf(path, tiny_tokenizer_json)
    out = import_gguf(path, tmp_path / "out", log=lambda *_: None)
    ours, theirs = Tokenizer.from_dir(out), hf_tokenizer_from_gguf(path)
    for text in TEXTS + [" hello world", "the theory of everything"]:
        ids = theirs(text)["input_ids"]
        assert ids[0] == 1 and ours.encode(text) == ids, text  # BOS first, as llama.cpp adds it
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_llama3_rope_freqs_become_rope_scaling(tmp_path, tiny_tokenizer_json):
    # What llama.cpp writes for Llama 3.2 (factor 32); transformers' loader drops it, we keep it.
    factors = llama_cpp_rope_factors(SHAPE["head_dim"], 10000.0, 32.0)
    assert 1.0 < factors[6] < 32.0 and factors[0] == 1.0 and factors[-1] == 32.0  # all three bands
    path = tmp_path / "llama3.gguf"
    write_gguf(path, tiny_tokenizer_json, types=("F16",), extra_tensors={"rope_freqs.weight": factors})
    out = import_gguf(path, tmp_path / "out", log=lambda *_: None)
    scaling = load_model_config(out).rope_scaling
    assert scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in load_file(str(out / "model.safetensors"))
    path = tmp_path / "other.gguf"
    write_gguf(path, tiny_tokenizer_json, types=("F16",),
               extra_tensors={"rope_freqs.weight": np.linspace(1, 4, 8, dtype=np.float32)})
    with pytest.raises(GGUFImportError, match="rope_freqs.weight is not Llama 3 rope scaling"):
        import_gguf(path, tmp_path / "out2", log=lambda *_: None)


def test_unsupported_architecture_is_refused(tmp_path):
    import gguf
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match=r"architecture 'phi3' is not supported; supported: llama, mistral, qwen2"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_is_refused_by_name(tmp_path, tiny_tokenizer_json):
    path = tmp_path / "q8_1.gguf"
    write_gguf(path, tiny_tokenizer_json, tensor_type_override=("blk.0.attn_q.weight", 9))  # Q8_1
    with pytest.raises(GGUFImportError, match=r"Q8_1 not supported; supported: F32, F16"):
        import_gguf(path, tmp_path / "out", log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_cli_import_gguf(tmp_path, tiny_tokenizer_json):
    path = tmp_path / "model.gguf"
    write_gguf(path, tiny_tokenizer_json, types=("Q8_0",))
    out = tmp_path / "ckpt"
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "client.cli", "import-gguf", str(path), "--out", str(out), *extra],
        capture_output=True, text=True, timeout=120)
    done = run()
    assert done.returncode == 0, done.stderr
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                              "tokenizer_config.json", "generation_config.json"}
    again = run()  # an existing folder is not overwritten without --force
    assert again.returncode == 2 and "--force" in again.stderr


def test_smollm2_matches_transformers_tensor_for_tensor(tmp_path):
    ours = load_file(str(smollm2_dir() / "model.safetensors"))
    gguf_path = smollm2_gguf(tmp_path)
    hf = hf_from_gguf(gguf_path)
    assert len(ours) == 272  # 30 layers x 9 + embedding + final norm; lm_head tied
    assert_same_tensors(ours, hf, tied=True)
    config = json.loads((smollm2_dir() / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["hidden_size"], config["vocab_size"]) == (30, 9, 3, 576, 49152)
    ours_tok, theirs = Tokenizer.from_dir(smollm2_dir()), hf_tokenizer_from_gguf(gguf_path)
    for text in TEXTS:
        assert ours_tok.encode(text) == theirs(text)["input_ids"], text
    assert (ours_tok.bos_token_id, ours_tok.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
