"""The run copy of the model repository that every tritonserver start serves from: written into a
temporary folder, the repository's own `llm/config.pbtxt` (the rendered file, hand edits and all)
with only the `--param`/`--model-path` overrides applied, `llm/1` linked to the repository's code,
and `llm_trtllm` beside it. The user's `config.pbtxt` stays the source of truth and is never
rewritten by a run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from serving.triton_install import ServerError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
MODEL_NAME = "llm"


def make_run_repository(dest: Path, model_repository: Path = DEFAULT_MODEL_REPOSITORY,
                        params: Optional[Mapping[str, str]] = None,
                        model_path: Optional[str] = None) -> Path:
    """Write a run copy of the model repository into `dest`, with parameter overrides applied.

    `llm/config.pbtxt` must exist in `model_repository` (`inflight config` renders it). Only the
    overridden parameters change; the rest of the file is the user's.
    """
    from templates.render import apply_overrides

    src = Path(model_repository).resolve() / MODEL_NAME
    config = src / "config.pbtxt"
    if not config.is_file():
        raise ServerError(f"{config} does not exist: render it first with `inflight config`")
    overrides = dict(params or {})
    if model_path is not None:
        overrides["model_path"] = str(Path(model_path).resolve())
    text = apply_overrides(config.read_text(), overrides)
    model_dir = Path(dest) / MODEL_NAME
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text)
    for version in sorted(p for p in src.iterdir() if p.is_dir() and p.name.isdigit()):
        link = model_dir / version.name
        if not link.exists():
            link.symlink_to(version.resolve(), target_is_directory=True)
    _add_trtllm_model(Path(dest))
    return Path(dest)


def _add_trtllm_model(dest: Path) -> None:
    """`llm_trtllm` beside `llm`: the same model in the TensorRT-LLM request format ([1, 1]
    shapes), which forwards to `llm` (model_repository/llm_trtllm/1/model.py)."""
    from templates.render import TRTLLM_MODEL, render_trtllm

    model_dir = dest / TRTLLM_MODEL
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render_trtllm())
    link = model_dir / "1"
    if not link.exists():
        link.symlink_to((DEFAULT_MODEL_REPOSITORY / TRTLLM_MODEL / "1").resolve(), target_is_directory=True)
