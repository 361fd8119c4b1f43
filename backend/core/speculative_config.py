"""`speculative_config`: what to speculate with, parsed and checked once. No torch, no numpy.

The value is JSON (a config.pbtxt string, `inflight serve --speculative-config`) or a dict (the
Python API), with vLLM's `SpeculativeConfig` keys where it has them:
- `method`: `ngram` (prompt lookup) or `draft_model`; left out, a `model` means `draft_model`
  (and `model: "ngram"` means `ngram`, as vLLM reads it);
- `num_speculative_tokens`: drafts per step and sequence (required);
- `prompt_lookup_min`, `prompt_lookup_max` (ngram): the n-gram lengths looked up; neither given
  means 5 and 5, one given sets the other (vLLM's defaults);
- `model` (draft_model): the draft checkpoint folder, with the target's vocabulary;
  `draft_sample_method`: `greedy` (argmax drafts, checked as point masses; vLLM's default) or
  `probabilistic` (drafts sampled from the draft's distribution q, checked against it);
  `max_model_len`: the draft's own limit (default: the draft checkpoint's, capped by the target's);
- `disable_by_batch_size`: no speculation in a step that runs more than this many sequences;
- inflight's own: `draft_kv_cache_tokens`, the draft's KV-cache capacity in tokens (default: as many
  as the target's cache holds; vLLM shares the target's cache instead).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

METHODS = ("ngram", "draft_model")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
MAX_SPECULATIVE_TOKENS = 32  # a verify row is 1 + k query tokens; beyond this acceptance rarely pays
MAX_PROMPT_LOOKUP = 64  # each step compares the last n tokens against the whole context
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
        "draft_sample_method", "max_model_len", "disable_by_batch_size", "draft_kv_cache_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str = ""
    draft_sample_method: str = "greedy"
    max_model_len: int = 0  # draft_model: 0 = the draft checkpoint's own
    disable_by_batch_size: Optional[int] = None  # None: speculate at any batch size
    draft_kv_cache_tokens: int = 0  # draft_model: 0 = as many tokens as the target's KV cache

    def enabled_for(self, batch_size: int) -> bool:
        """Speculate in a step of this many sequences?"""
        return self.disable_by_batch_size is None or batch_size <= self.disable_by_batch_size


def parse_speculative_config(value: Union[str, Mapping[str, Any], None]) -> Optional[SpeculativeConfig]:
    """None for an empty value; else the checked config. Raises ValueError naming the key."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config must be a JSON object; {exc.msg} at character {exc.pos}") from None
    else:
        data = value
    if not isinstance(data, Mapping):
        raise ValueError(f"speculative_config must be a JSON object; got {type(data).__name__}")
    if not data:
        return None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key '{unknown[0]}'; allowed keys: {', '.join(KEYS)}")
    model = _text(data, "model")
    method = _text(data, "method") or ("ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else "")
    if method == "[ngram]":
        method = "ngram"
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}"
                         + (f"; got '{method}'" if method else " (or give a draft 'model')"))
    if "num_speculative_tokens" not in data:
        raise ValueError("speculative_config.num_speculative_tokens is required: the drafts proposed per step "
                         f"(1..{MAX_SPECULATIVE_TOKENS})")
    k = _int(data, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    fields: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if "disable_by_batch_size" in data and data["disable_by_batch_size"] is not None:
        fields["disable_by_batch_size"] = _int(data, "disable_by_batch_size", 1, None)
    if method == "ngram":
        _only_for(data, "ngram", ("model", "draft_sample_method", "max_model_len", "draft_kv_cache_tokens"),
                  allow_model="ngram")
        low = _int(data, "prompt_lookup_min", 1, MAX_PROMPT_LOOKUP) if data.get("prompt_lookup_min") is not None else None
        high = _int(data, "prompt_lookup_max", 1, MAX_PROMPT_LOOKUP) if data.get("prompt_lookup_max") is not None else None
        low, high = (5, 5) if low is None and high is None else (low or high, high or low)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        fields.update(prompt_lookup_min=low, prompt_lookup_max=high)
    else:
        _only_for(data, "draft_model", ("prompt_lookup_min", "prompt_lookup_max"))
        if not model:
            raise ValueError("speculative_config.model is required with method draft_model: the draft "
                             "checkpoint folder (same tokenizer and vocabulary as the target)")
        sample = _text(data, "draft_sample_method") or "greedy"
        if sample not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config.draft_sample_method must be one of "
                             f"{', '.join(DRAFT_SAMPLE_METHODS)}; got '{sample}'")
        fields.update(model=model, draft_sample_method=sample)
        if data.get("max_model_len") is not None:
            fields["max_model_len"] = _int(data, "max_model_len", 1, None)
        if data.get("draft_kv_cache_tokens") is not None:
            fields["draft_kv_cache_tokens"] = _int(data, "draft_kv_cache_tokens", 0, None)
    return SpeculativeConfig(**fields)


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"speculative_config.{key} must be a string; got {value!r}")
    return value.strip()


def _int(data: Mapping[str, Any], key: str, low: int, high: Optional[int]) -> int:
    value = data[key]
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        limit = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"speculative_config.{key} must be an integer {limit}; got {value!r}")
    return value


def _only_for(data: Mapping[str, Any], method: str, foreign: tuple[str, ...], allow_model: str = "") -> None:
    for key in foreign:
        if data.get(key) is not None and not (key == "model" and data[key] in (allow_model, f"[{allow_model}]")):
            raise ValueError(f"speculative_config.{key} does not apply to method {method}")


def resolve_draft_path(value: str, root) -> str:
    """speculative_config with a relative draft `model` made absolute from `root` (the repository
    root for config.pbtxt, as model_path; the working directory for the command line). A value
    that is not a JSON object is returned as it is: EngineConfig refuses it with the reason."""
    import os

    try:
        data = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        return value
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str) or not model.strip() or model in ("ngram", "[ngram]") or os.path.isabs(model):
        return value
    return json.dumps({**data, "model": os.path.abspath(os.path.join(str(root), model))})
