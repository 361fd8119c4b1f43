"""Adapters that do not fit are refused naming the adapter and the module (backend/models/lora/peft_format.py),
never unpickled; where adapters come from (multi_lora.json, lora_modules, --lora-modules) and the
config keys (backend/core/lora.py, EngineConfig)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from backend.core.config import EngineConfig
from backend.models.loader import load_model_config
from backend.models.lora.peft_format import load_adapter
from backend.core.lora import adapter_sources, parse_lora_modules, read_multi_lora
from backend.models.make_model import make_model
from hf_checkpoints import make_checkpoint
from lora_adapters import AdapterSpec, make_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("lora-checks") / "base")


@pytest.fixture(scope="module")
def cfg(base):
    return load_model_config(base)


def test_a_fitting_adapter_loads_with_its_rank_modules_and_scaling(base, cfg, tmp_path):
    spec = AdapterSpec(r=8, alpha=32, targets=("q_proj", "down_proj"), use_rslora=True)
    adapter = load_adapter("ok", str(make_adapter(base, tmp_path / "ok", 1, spec)), cfg, max_lora_rank=8)
    assert adapter.rank == 8 and adapter.modules == ("q_proj", "down_proj")
    (a, b), k, v = adapter.weights[(0, "qkv_proj")]
    assert k is None and v is None and a.shape == (8, cfg.hidden_size)
    from safetensors.torch import load_file
    raw = load_file(str(tmp_path / "ok" / "adapter_model.safetensors"))
    raw_b = raw["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.allclose(b, raw_b * 32 / 8 ** 0.5)  # rsLoRA's scaling, folded into lora_B


def test_an_adapter_made_for_another_model_is_refused_naming_the_module(base, cfg, tmp_path):
    other = make_checkpoint("llama", tmp_path / "other")   # hidden 64, not the base's 256
    path = make_adapter(other, tmp_path / "other-lora", 1, AdapterSpec(targets=("v_proj",)))
    with pytest.raises(ValueError, match=r"LoRA adapter 'x' \(\S+\): module 'layers\.0\.self_attn\.v_proj': .*\(8, 64\).*"
                                         r"expected \(8, 256\).*another model"):
        load_adapter("x", str(path), cfg, 16)


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
def test_adapters_on_modules_the_engine_does_not_serve_are_refused_by_name(base, cfg, tmp_path, module):
    path = make_adapter(base, tmp_path / module, 1, AdapterSpec(targets=("q_proj", module)))
    with pytest.raises(ValueError, match=rf"LoRA adapter 'y' \(\S+\): module '(model\.)?{module}'.* not supported"):
        load_adapter("y", str(path), cfg, 16)


def test_a_rank_above_max_lora_rank_is_refused(base, cfg, tmp_path):
    path = make_adapter(base, tmp_path / "r32", 1, AdapterSpec(r=32, targets=("o_proj",)))
    with pytest.raises(ValueError, match=r"'big' \(\S+\): module 'layers\.0\.self_attn\.o_proj' has rank 32, above max_lora_rank=16"):
        load_adapter("big", str(path), cfg, 16)


def test_dora_biases_and_whole_modules_are_refused_from_the_config(base, cfg, tmp_path):
    path = make_adapter(base, tmp_path / "plain", 1, AdapterSpec(targets=("q_proj",)))
    config = json.loads((path / "adapter_config.json").read_text())
    for key, value, message in [("use_dora", True, "DoRA"), ("bias", "lora_only", "LoRA biases"),
                                ("modules_to_save", ["lm_head"], "modules_to_save"), ("peft_type", "IA3", "only LORA")]:
        (path / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=rf"LoRA adapter 'z' \(\S+\): .*{message}"):
            load_adapter("z", str(path), cfg, 16)


def test_a_pickled_adapter_is_never_loaded(base, cfg, tmp_path):
    path = make_adapter(base, tmp_path / "pickled", 1, AdapterSpec(targets=("q_proj",)))
    shutil.move(path / "adapter_model.safetensors", path / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"no adapter_model.safetensors \(adapter_model.bin is a pickle and is never loaded"):
        load_adapter("p", str(path), cfg, 16)
    with pytest.raises(ValueError, match="no adapter folder"):
        load_adapter("p", str(tmp_path / "missing"), cfg, 16)


def test_lora_modules_accepts_vllms_forms():
    assert parse_lora_modules("a=/x, b=/y") == {"a": "/x", "b": "/y"}
    assert parse_lora_modules('{"a": "/x"}') == {"a": "/x"}
    assert parse_lora_modules(['{"name": "a", "path": "/x"}', "b=/y"]) == {"a": "/x", "b": "/y"}
    assert parse_lora_modules("{}") == {} == parse_lora_modules("")
    for bad, message in [("a", "not NAME=PATH"), ("a=", "needs a folder"), ("bad name=/x", "an adapter name"),
                         ("a=/x,a=/y", "given twice"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)


def test_multi_lora_json_paths_are_taken_from_its_folder(tmp_path):
    (tmp_path / "multi_lora.json").write_text('{"rel": "adapters/one", "abs": "/srv/two"}')
    assert read_multi_lora(tmp_path) == {"rel": str(tmp_path / "adapters" / "one"), "abs": "/srv/two"}
    assert adapter_sources(tmp_path, "abs=/other") == {"rel": str(tmp_path / "adapters" / "one"), "abs": "/other"}
    (tmp_path / "multi_lora.json").write_text('["not", "an", "object"]')
    with pytest.raises(ValueError, match="multi_lora.json must be a JSON object"):
        read_multi_lora(tmp_path)


def test_config_keys_are_checked():
    with pytest.raises(ValueError, match="lora_modules needs enable_lora=true"):
        EngineConfig(lora_modules="a=/x")
    with pytest.raises(ValueError, match="max_loras must be >= 1"):
        EngineConfig(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        EngineConfig.from_params({"enable_lora": "true", "max_lora_rank": "0"})
    assert EngineConfig.from_params({"enable_lora": "true", "lora_modules": "a=/x"}).lora_modules == "a=/x"


def test_inflight_serve_lora_modules_becomes_the_parameters(tmp_path, monkeypatch):
    from client.cli import build_parser
    from client.serve import lora_params
    from client.protocol import Options

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["serve", "--lora-modules", "sql=adapters/sql", '{"name": "poet", "path": "/p"}'])
    params = lora_params(args.lora_modules, {"lora_modules": "old=/o"})
    assert params["enable_lora"] == "true"
    assert json.loads(params["lora_modules"]) == {"old": "/o", "sql": str(tmp_path / "adapters" / "sql"), "poet": "/p"}
    assert EngineConfig.from_params(params).lora_modules == params["lora_modules"]
    # the client library sends lora_name as a request parameter (the vLLM backend reads it there too)
    assert Options(lora_name="sql", max_tokens=3).parameters() == {"lora_name": "sql"}
