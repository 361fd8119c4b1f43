"""The adapters a configured engine serves, from its config.pbtxt parameters alone (no engine):
what the OpenAI server lists as models beside the base one."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Union

from backend.core.config import EngineConfig
from backend.core.lora import adapter_sources, check_adapter_name


def configured_adapters(params: Mapping[str, str], repo_root: Union[str, Path, None] = None) -> dict[str, str]:
    """The adapters an engine with these config.pbtxt parameters loads at start ({} without
    enable_lora). A relative model_path is taken from the repository root, as the Triton model
    takes it. With skip_invalid_lora_adapters the engine starts without the adapters it cannot
    load, so only those its own check accepts are listed (read here once: torch loads for it)."""
    config = EngineConfig.from_params(params)
    if not config.enable_lora:
        return {}
    model_path = config.model_path
    if model_path and not Path(model_path).is_absolute():
        model_path = str(Path(repo_root or Path(__file__).resolve().parents[3]) / model_path)
    sources = adapter_sources(model_path, config.lora_modules)
    if config.skip_invalid_lora_adapters and sources:
        from backend.models.loader import load_model_config
        model_cfg = load_model_config(model_path)
        sources = {name: path for name, path in sources.items()
                   if _loads(name, path, model_cfg, config)}
    return sources


def _loads(name: str, path: str, model_cfg, config: EngineConfig) -> bool:
    """Whether the engine's start would load this adapter (backend/worker/lora/manager.py: the same checks)."""
    from backend.models.lora.peft_format import load_adapter
    try:
        check_adapter_name(name, "LoRA adapter", config.served_model_name)
        load_adapter(name, path, model_cfg, config.max_lora_rank)
    except ValueError:
        return False
    return True
