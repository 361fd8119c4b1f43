"""Where LoRA adapters come from, and how requests name them. No torch here.

- `multi_lora.json` in the checkpoint folder: the vLLM backend's file, a JSON object of adapter
  name -> adapter folder (a relative folder is taken from the JSON file's folder).
- the `lora_modules` engine parameter, which `inflight serve --lora-modules NAME=PATH ...` fills
  (vLLM's flag): a JSON object like multi_lora.json, or `NAME=PATH` entries separated by commas.
- at run time, `LLM.load_lora(name, path)` / a `LoRARequest` with a path (docs/lora.md).

A request names its adapter with `lora_name` (the vLLM backend's sampling key), a `LoRARequest`
(vLLM's Python API), or the OpenAI API's `model`.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

MULTI_LORA_FILE = "multi_lora.json"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: the adapter a request runs with.
    A name the engine has loaded is enough; with a path, an adapter not loaded yet is loaded on
    first use (as vLLM does). `lora_int_id` is accepted for vLLM's signature; names identify
    adapters here."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


LoRALike = Union[LoRARequest, str, None]


def check_name(name: Any, source: str = "lora_name") -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{source}: an adapter name is 1..128 characters of letters, digits and ._:/@+- "
                         f"(starting with a letter or digit); got {name!r}")
    return name


def check_adapter_name(name: Any, source: str = "LoRA adapter", served_model_name: str = "llm") -> str:
    """An adapter's name at load: a valid name, and not the served model's (`llm`, the Triton model,
    or `served_model_name`): the OpenAI door would serve the base model under it and the Triton door
    the adapter, different weights for one name."""
    check_name(name, source)
    taken = sorted({"llm", served_model_name})
    if name in taken:
        raise ValueError(f"{source}: LoRA adapter '{name}' is named like the served model (the base model's "
                         f"name{'s are' if len(taken) > 1 else ' is'} {' and '.join(taken)}); give the adapter a "
                         "name of its own")
    return name


def parse_lora_modules(value: Union[str, Mapping[str, str], list, None]) -> dict[str, str]:
    """The `lora_modules` parameter (or the `--lora-modules` values) -> {name: path}. Accepts a JSON
    object, `NAME=PATH` entries separated by commas or given as a list, and vLLM's JSON entries
    `{"name": ..., "path": ...}`."""
    if value is None or value == "" or value == []:
        return {}
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list):
        items = [_entry(v) for v in value]
    else:
        text = str(value).strip()
        if text.startswith("{"):
            data = _json(text, "lora_modules")
            if set(data) >= {"name", "path"} and isinstance(data.get("name"), str):
                items = [(data["name"], data["path"])]  # one of vLLM's JSON entries
            else:
                items = list(data.items())
        else:
            items = [_entry(part) for part in text.split(",") if part.strip()]
    out: dict[str, str] = {}
    for name, path in items:
        check_name(name, "lora_modules")
        if not isinstance(path, str) or not path.strip():
            raise ValueError(f"lora_modules: adapter '{name}' needs a folder path; got {path!r}")
        if name in out and out[name] != path:
            raise ValueError(f"lora_modules: adapter '{name}' is given twice ({out[name]} and {path})")
        out[name] = path.strip()
    return out


def _entry(item: Any) -> tuple[str, str]:
    if isinstance(item, Mapping):
        return item.get("name"), item.get("path")
    text = str(item).strip()
    if text.startswith("{"):
        data = _json(text, "lora_modules")
        return data.get("name"), data.get("path")
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"lora_modules: '{text}' is not NAME=PATH")
    return name.strip(), path.strip()


def _json(text: str, source: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source} must be a JSON object of adapter name -> folder")
    return data


def read_multi_lora(model_path: Union[str, Path]) -> dict[str, str]:
    """The checkpoint folder's multi_lora.json as {name: absolute folder}; {} when there is none."""
    path = Path(model_path) / MULTI_LORA_FILE
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    data = _json(text, str(path))
    out = {}
    for name, folder in data.items():
        check_name(name, str(path))
        if not isinstance(folder, str) or not folder:
            raise ValueError(f"{path}: adapter '{name}' must map to a folder path; got {folder!r}")
        out[name] = str((path.parent / folder).resolve()) if not Path(folder).is_absolute() else folder
    return out


def adapter_sources(model_path: Union[str, Path], lora_modules: Union[str, Mapping, list, None]) -> dict[str, str]:
    """Every adapter to load at start: multi_lora.json's, then lora_modules' (which win on a name
    given by both, as a command line overrides a file)."""
    found = read_multi_lora(model_path) if model_path else {}
    found.update(parse_lora_modules(lora_modules))
    return found


def cache_salt(name: str, load_id: int) -> bytes:
    """The root of an adapter's prefix-cache keys (backend/kv/block_manager.py): the same prompt under
    two adapters, or under the base model, never shares KV. Unique per load, so an adapter loaded
    again under an old name never meets the old one's cached blocks."""
    return hashlib.sha256(f"lora\0{name}\0{load_id}".encode()).digest()


def lora_name_of(lora: LoRALike) -> Optional[str]:
    if lora is None:
        return None
    return check_name(lora.lora_name if isinstance(lora, LoRARequest) else lora)

