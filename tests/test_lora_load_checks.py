"""Hostile or damaged LoRA adapters are refused at load with one line naming the adapter, its folder
and the problem (backend/models/lora/peft_format.py), never a ZeroDivisionError, IndexError, re.error or
SafetensorError from deep inside; at start the model refuses to start, or starts with the good
adapters under skip_invalid_lora_adapters (backend/worker/lora/manager.py)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLM
from backend.models.loader import load_model_config
from backend.models.lora.peft_format import load_adapter
from backend.models.make_model import make_model
from lora_adapters import AdapterSpec, make_adapter

pytestmark = pytest.mark.slow  # PEFT writes the adapters: seconds of set-up

WEIGHTS = "adapter_model.safetensors"
A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("lora-load") / "base")


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return make_adapter(base, tmp_path_factory.mktemp("lora-load") / "good", 1, AdapterSpec(targets=("q_proj",)))


def _config(**changes):
    def change(folder):
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return change


def _tensors(fn):
    def change(folder):
        tensors = load_file(str(folder / WEIGHTS))
        fn(tensors)
        save_file(tensors, str(folder / WEIGHTS))
    return change


def _corrupt(folder):
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])  # truncated mid-tensor


def _garbage_header(folder):
    (folder / WEIGHTS).write_bytes(b"\xff" * 64)


def _poison(value):
    def fn(t):
        t[B_KEY][3, 1] = value
    return fn


def _scalar_a(t):
    t[A_KEY] = torch.tensor(1.0)


def _int_a(t):
    t[A_KEY] = torch.ones_like(t[A_KEY], dtype=torch.int32)


CASES = {
    "r: 0": (_config(r=0), "r must be an integer >= 1; got 0"),
    "r: eight": (_config(r="eight"), "r must be an integer >= 1; got 'eight'"),
    "lora_alpha: abc": (_config(lora_alpha="abc"), "lora_alpha must be a finite number; got 'abc'"),
    "lora_alpha: NaN": (_config(lora_alpha=float("nan")), "lora_alpha must be a finite number"),
    "rank_pattern regex": (_config(rank_pattern={"q_proj(": 8}), "rank_pattern key 'q_proj(' is not a valid regular"),
    "rank_pattern value": (_config(rank_pattern={"q_proj": "x"}), "rank_pattern['q_proj'] must be an integer >= 1"),
    "alpha_pattern not a dict": (_config(alpha_pattern=[1]), "alpha_pattern must be an object"),
    "use_rslora: yes": (_config(use_rslora="yes"), "use_rslora must be true or false"),
    "scalar lora_A": (_tensors(_scalar_a), "has shape (); a LoRA weight is a non-empty matrix"),
    "integer lora_A": (_tensors(_int_a), "is torch.int32; LoRA weights are floating point"),
    "NaN weight": (_tensors(_poison(float("nan"))), "holds 1 NaN or infinite value(s)"),
    "Inf weight": (_tensors(_poison(float("inf"))), "holds 1 NaN or infinite value(s)"),
    "alpha overflows": (_config(lora_alpha=1e300), "overflows float32"),
    "truncated file": (_corrupt, "adapter_model.safetensors is not a readable safetensors file"),
    "garbage file": (_garbage_header, "adapter_model.safetensors is not a readable safetensors file"),
    "config not JSON": (lambda f: (f / "adapter_config.json").write_text("{"), "adapter_config.json is not readable JSON"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_adapter_is_one_line_naming_it_its_folder_and_the_problem(base, good, tmp_path, case):
    break_it, problem = CASES[case]
    folder = tmp_path / "bad"
    shutil.copytree(good, folder)
    break_it(folder)
    with pytest.raises(ValueError) as err:
        load_adapter("bad", str(folder), load_model_config(base), 16)
    message = str(err.value)
    assert message.startswith(f"LoRA adapter 'bad' ({folder}): ") and problem in message, message
    assert "\n" not in message


def test_the_model_refuses_to_start_on_a_bad_adapter_or_starts_with_the_good_ones(base, good, tmp_path):
    bad = tmp_path / "nan"
    shutil.copytree(good, bad)
    _tensors(_poison(float("nan")))(bad)
    modules = f"good={good},nan={bad}"
    with pytest.raises(ValueError) as err:  # vLLM's default: a --lora-modules adapter that fails stops the start
        LLM(str(base), max_model_len=64, enable_lora=True, lora_modules=modules)
    lines = str(err.value).splitlines()
    assert "1 of 2 LoRA adapter(s) cannot be loaded" in lines[0] and "skip_invalid_lora_adapters" in lines[0]
    assert lines[1:] == [f"LoRA adapter 'nan' ({bad}): tensor {B_KEY} holds 1 NaN or infinite value(s)"]
    llm = LLM(str(base), max_model_len=64, enable_lora=True, lora_modules=modules, skip_invalid_lora_adapters=True)
    assert llm.list_loras() == ["good"]
    out = llm.generate([[5, 6, 7]], lora_request="good")[0]
    assert out.finish_reason in ("stop", "length") and llm.stats()["kv_blocks_used"] == 0
    with pytest.raises(ValueError, match="LoRA adapter 'nan' is not loaded; loaded adapters: good"):
        llm.generate([[5, 6, 7]], lora_request="nan")


def test_the_openai_server_lists_only_the_adapters_the_engine_loads(base, good, tmp_path):
    """/v1/models lists a configured engine's adapters (backend/models/lora/served.py): all of them when a
    bad one stops the start, and under skip_invalid_lora_adapters only those the engine loads."""
    from backend.models.lora.served import configured_adapters
    bad = tmp_path / "nan"
    shutil.copytree(good, bad)
    _tensors(_poison(float("nan")))(bad)
    params = {"model_path": str(base), "enable_lora": "true", "lora_modules": f"good={good},nan={bad}"}
    assert configured_adapters(params) == {"good": str(good), "nan": str(bad)}
    skipping = configured_adapters({**params, "skip_invalid_lora_adapters": "true"})
    llm = LLM(str(base), max_model_len=64, enable_lora=True, lora_modules=params["lora_modules"],
              skip_invalid_lora_adapters=True)
    assert skipping == {"good": str(good)} and list(skipping) == llm.list_loras()
