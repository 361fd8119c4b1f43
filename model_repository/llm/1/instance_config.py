"""config.pbtxt parameters and the instance Triton placed this model on -> the engine's config.
Free of Triton imports (unit-tested without a server); adapter.py re-exports `engine_config`."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

from backend.core.config import EngineConfig
from backend.core.kv_events_config import HOST_ENV, for_instance
from serving.triton_log import ENGINE_REPORT  # the line's prefix, one literal for the writer and its reader


def engine_config(params: Mapping[str, str], instance_kind: str, device_id: int | str,
                  repo_root: Path, instance_name: str = "") -> EngineConfig:
    """config.pbtxt parameters -> EngineConfig, in one place (EngineConfig.from_params validates).

    `device: auto` follows the instance: a GPU instance -> cuda:<device_id>, anything else -> cpu;
    `device: cuda` in a GPU instance is its GPU too. Triton's Python backend passes the kind as
    TRITONSERVER_InstanceGroupKindString writes it ("GPU", "CPU", "MODEL"); config.pbtxt's
    "KIND_GPU" is accepted as well. A relative `model_path` (and a relative draft `model` in
    `speculative_config`, and a relative `kv_disk_cache_dir`) is taken from the repository root.

    Tensor parallelism (docs/parallelism.md): an engine of tensor_parallel_size N uses the
    instance's device and the N - 1 after it. A KIND_MODEL instance (which places itself, as the
    vLLM backend's multi-GPU instances do) where GPUs exist starts at cuda:i*N, i its index in the
    group (`llm_0_<i>`), so `count: K` gives K groups on disjoint devices; a KIND_GPU instance
    starts at its own GPU (list every N-th: `gpus: [0, 2]`).
    """
    overrides: dict[str, Any] = {}
    device = str(params.get("device", "auto")).strip()
    on_gpu = instance_kind in ("GPU", "KIND_GPU")
    if device in ("", "auto") or (device == "cuda" and on_gpu):
        overrides["device"] = f"cuda:{int(device_id)}" if on_gpu else "cpu"
    model_path = str(params.get("model_path", "")).strip()
    if model_path and not Path(model_path).is_absolute():
        overrides["model_path"] = str((Path(repo_root) / model_path).resolve())
    disk_dir = str(params.get("kv_disk_cache_dir", "")).strip()
    if disk_dir and not Path(disk_dir).is_absolute():  # the KV tiers' disk folder, found like model_path
        overrides["kv_disk_cache_dir"] = str((Path(repo_root) / disk_dir).resolve())
    if str(params.get("speculative_config", "")).strip():  # its draft `model` is found like model_path
        from backend.core.speculative_config import resolve_draft_path
        overrides["speculative_config"] = resolve_draft_path(str(params["speculative_config"]), repo_root)
    config = EngineConfig.from_params(params, **overrides)
    index = int(instance_name.rsplit("_", 1)[-1]) if instance_name.rsplit("_", 1)[-1].isdigit() else 0
    if instance_kind in ("MODEL", "KIND_MODEL") and device in ("", "auto") and _gpu_count():
        config = dataclasses.replace(config, device=f"cuda:{index * config.tensor_parallel_size}")
    if config.kv_events_config:  # instance i publishes KV events on its own ports (vLLM's DP ranks), on --host
        events = for_instance(config.kv_events_config, index, os.environ.get(HOST_ENV, ""))
        config = dataclasses.replace(config, kv_events_config=events)
    if not config.model_path:
        raise ValueError("parameter 'model_path' is required: a Hugging Face checkpoint folder")
    if not Path(config.model_path).is_dir():
        raise ValueError(f"parameter 'model_path': no checkpoint folder at {config.model_path} "
                         "(make one with `inflight make-model`, or point it at a HF checkpoint)")
    return config


def _gpu_count() -> int:
    """CUDA devices this process sees (torch loads here, only for KIND_MODEL instances)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def engine_report(config: EngineConfig, cpu_placement: list, frozen_objects: int) -> str:
    """One log line: the effective EngineConfig, the engine thread's CPU team (each thread's cores,
    AsyncEngine.cpu_placement), the OpenMP environment the stub was given, and how many objects its
    start froze out of the garbage collector's walks (backend/core/gc_heap.py), as JSON, so a served
    engine can be held to an in-process one built from the same parameters (issue 47); model.py logs
    it at start and serving/triton_log.py's engine_reports reads it back."""
    omp = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OMP_", "GOMP_", "KMP_", "INFLIGHT_CPU"))}
    return ENGINE_REPORT + json.dumps({"config": dataclasses.asdict(config), "cpu_placement": cpu_placement,
                                       "env": omp, "frozen_objects": frozen_objects}, sort_keys=True)
