"""Issue 46, cause 11: a LoRA adapter named like the served model (`llm`, or `served_model_name`) is
refused at load, with one line naming it: in lora_modules (the config's check), in the checkpoint's
multi_lora.json (the engine's start) and at run time (LLM.load_lora). Before, `/v1/models` listed `llm` twice and the two doors served different
weights under that name. The name is checked before the adapter's folder is read: the folders here
need not exist."""
from __future__ import annotations

import json

import pytest

from backend import LLM
from backend.core.config import EngineConfig


@pytest.mark.parametrize("served, name", [("llm", "llm"), ("mine", "mine"), ("mine", "llm")])
def test_lora_modules_naming_the_served_model_are_refused(served, name):
    with pytest.raises(ValueError) as err:
        EngineConfig(enable_lora=True, served_model_name=served, lora_modules=f"{name}=/adapters/a")
    message = str(err.value)
    assert f"LoRA adapter '{name}' is named like the served model" in message and "\n" not in message, message
    EngineConfig(enable_lora=True, served_model_name=served, lora_modules="sql=/adapters/a")  # a name of its own


def test_the_engine_refuses_such_an_adapter_at_start_and_at_run_time(default_model_dir, tmp_path):
    checkpoint = tmp_path / "m"
    checkpoint.mkdir()
    for item in default_model_dir.iterdir():
        (checkpoint / item.name).symlink_to(item)
    (checkpoint / "multi_lora.json").write_text(json.dumps({"llm": str(tmp_path / "nowhere")}))
    with pytest.raises(ValueError, match="LoRA adapter 'llm' is named like the served model"):
        LLM(str(checkpoint), enable_lora=True)
    (checkpoint / "multi_lora.json").unlink()
    llm = LLM(str(checkpoint), enable_lora=True, served_model_name="mine")
    try:
        for name in ("llm", "mine"):
            with pytest.raises(ValueError, match=f"LoRA adapter '{name}' is named like the served model"):
                llm.load_lora(name, str(tmp_path / "nowhere"))
        assert llm.list_loras() == []
    finally:
        llm.engine.close()
