"""Which runner a checkpoint gets and, for the pooling runner, how it pools (docs/pooling.md).

As vLLM's `--runner auto`: a checkpoint with sentence-transformers files (`modules.json`), a bare
decoder (`Qwen3Model`, ...) or a score head (`*ForSequenceClassification`) is served by the pooling
runner; any other by the generate runner. The pooling itself follows the checkpoint as
sentence-transformers would: `modules.json`'s Pooling module folder (`1_Pooling/config.json`:
`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`) and whether a
`Normalize` module follows it. With no such files, a decoder pools its last token and normalizes
(vLLM's default for decoder embedding models); a score head pools the last token (vLLM, and
transformers' *ForSequenceClassification: the last non-padding token). Matryoshka sizes come from
config.json's `matryoshka_dimensions` (a list) or `is_matryoshka: true` (any size), vLLM's keys.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from backend.core.pooling import PoolingConfig
from backend.models.loader import ModelConfig

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path.parent.name}/{path.name} is not readable JSON: {exc}") from None


def resolve_runner(runner: str, model_dir: str | Path, cfg: ModelConfig) -> Optional[PoolingConfig]:
    """The pooling configuration when `runner` (auto | generate | pooling) serves this checkpoint
    by pooling; None for the generate runner. Refuses what cannot be served that way."""
    model_dir = Path(model_dir)
    sentence_transformers = (model_dir / "modules.json").is_file()
    if runner == "generate":
        if cfg.head:
            raise ValueError(f"runner generate: {model_dir.name} is a {cfg.checkpoint_architecture} checkpoint "
                             "(no language-model head); serve it with runner pooling (or auto)")
        return None
    if runner == "auto" and not (sentence_transformers or cfg.head):
        return None
    if cfg.head == "score":
        return PoolingConfig(task="classify", pooling_type="last", normalize=False, num_labels=cfg.num_labels,
                             hidden_size=cfg.hidden_size)
    pooling_type, normalize = "last", True
    if sentence_transformers:
        pooling_type, normalize = _sentence_transformers(model_dir)
    return PoolingConfig(task="embed", pooling_type=pooling_type, normalize=normalize,
                         matryoshka_dimensions=_matryoshka(model_dir), hidden_size=cfg.hidden_size)


def _sentence_transformers(model_dir: Path) -> tuple[str, bool]:
    modules = _json(model_dir / "modules.json")
    if not isinstance(modules, list):
        raise ValueError("modules.json must be a list of modules (sentence-transformers' format)")
    kinds = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules if isinstance(m, dict)]
    pooling_dir = next((path for kind, path in kinds if kind.endswith(".Pooling")), None)
    normalize = any(kind.endswith(".Normalize") for kind, _ in kinds)
    if pooling_dir is None:
        return "last", normalize
    settings = _json(model_dir / pooling_dir / "config.json")
    chosen = [name for key, name in _MODES if isinstance(settings, dict) and settings.get(key)]
    others = [k for k, v in (settings.items() if isinstance(settings, dict) else ())
              if k.startswith("pooling_mode_") and v and k not in dict(_MODES)]
    if len(chosen) != 1 or others:
        raise ValueError(f"{pooling_dir}/config.json: inflight pools by exactly one of "
                         f"{', '.join(k for k, _ in _MODES)}; got {sorted(others) + chosen or 'none'}")
    return chosen[0], normalize


def _matryoshka(model_dir: Path) -> Optional[tuple[int, ...]]:
    cfg = _json(model_dir / "config.json")
    dims = cfg.get("matryoshka_dimensions") if isinstance(cfg, dict) else None
    if isinstance(dims, list) and dims and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        return tuple(dims)
    if isinstance(cfg, dict) and cfg.get("is_matryoshka") is True:
        return None
    return ()
