"""The adapters a configured engine serves, from its config.pbtxt parameters alone (no engine, no
torch): what the OpenAI server lists as models beside the base one."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Union

from backend.config import EngineConfig
from backend.lora.sources import adapter_sources


def configured_adapters(params: Mapping[str, str], repo_root: Union[str, Path, None] = None) -> dict[str, str]:
    """The adapters an engine with these config.pbtxt parameters loads at start ({} without
    enable_lora). A relative model_path is taken from the repository root, as the Triton model
    takes it."""
    config = EngineConfig.from_params(params)
    if not config.enable_lora:
        return {}
    model_path = config.model_path
    if model_path and not Path(model_path).is_absolute():
        model_path = str(Path(repo_root or Path(__file__).resolve().parents[2]) / model_path)
    return adapter_sources(model_path, config.lora_modules)
