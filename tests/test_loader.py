"""Checkpoint loading: sharded safetensors, pickles refused, missing tokenizer, bad weights."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLM, SamplingParams
from backend.models.loader import load_model_config


def test_sharded_checkpoint_gives_the_same_tokens(default_model_dir, tmp_path):
    weights = load_file(str(default_model_dir / "model.safetensors"))
    sharded = tmp_path / "sharded"
    shutil.copytree(default_model_dir, sharded)
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(sharded / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    p = SamplingParams(max_tokens=8, temperature=0)
    assert LLM(str(sharded)).generate(["shards"], p)[0].token_ids == \
        LLM(str(default_model_dir)).generate(["shards"], p)[0].token_ids


def test_pickled_weights_are_refused_without_unpickling(default_model_dir, tmp_path):
    ckpt = tmp_path / "pickled"
    ckpt.mkdir()
    shutil.copy(default_model_dir / "config.json", ckpt)
    # A pickle that would create a file if it were ever loaded.
    marker = tmp_path / "pwned"
    (ckpt / "pytorch_model.bin").write_bytes(
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(ValueError, match="refusing pickled weights.*safetensors"):
        LLM(str(ckpt))
    assert not marker.exists()


def test_checkpoint_without_tokenizer_serves_token_ids_only(default_model_dir, tmp_path):
    ckpt = tmp_path / "no-tok"
    ckpt.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(default_model_dir / name, ckpt)
    llm = LLM(str(ckpt))
    out = llm.generate([[1, 10, 20]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer.json: send input_ids"):
        llm.generate(["text"], SamplingParams(max_tokens=2))


def test_missing_and_misshaped_weights_are_named(default_model_dir, tmp_path):
    weights = load_file(str(default_model_dir / "model.safetensors"))
    broken = tmp_path / "broken"
    shutil.copytree(default_model_dir, broken)
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights.*layers.1.self_attn.qkv_proj"):
        LLM(str(broken))
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(broken))


def test_unsupported_architecture_and_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="architectures is .*; it must list one of LlamaForCausalLM"):
        load_model_config(tmp_path)
