"""What the worker reads off its device for sizing (backend/kv/sizing.py has the rules): the free
memory and the warm-up's activation peak, what is available for an allocation, the draft model's
share, and one engine sizing at a time per GPU.

Several engines on one GPU (`instance_group { count: 2 }`): Triton loads the instances in
parallel, in separate processes. Each would read the same free memory and take the same share of
it. `one_engine_at_a_time` holds an exclusive lock file per physical GPU (its UUID) around weight
loading, sizing, the cache allocation and graph capture, so the second engine measures what the
first left: with fraction f, the first gets f of the free memory and the second f of the rest.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from backend.kv.sizing import Available, CacheShare, GpuMemory, kv_bytes_per_token
from backend.models.loader import load_model_config, weight_files

if TYPE_CHECKING:
    import torch

    from backend.core.config import EngineConfig
    from backend.worker.device import DeviceEnv

log = logging.getLogger(__name__)
LOCK_DIR_ENV = "INFLIGHT_LOCK_DIR"   # where the per-GPU lock files go (default: the temp folder)


def measure(env: "DeviceEnv", warm_up: Callable[[], None]) -> GpuMemory:
    """Free memory before the warm-up and the warm-up's activation peak (steps 1 and 2 above)."""
    env.synchronize()
    env.release_cached()
    free, total = env.mem_get_info()
    before = env.reset_peak()
    warm_up()
    env.synchronize()
    return GpuMemory(free, total, max(0, env.peak_allocated() - before))


def available_bytes(env: "DeviceEnv") -> Available:
    """(bytes available for new allocations, where) on the engine's device: the GPU's free memory
    (its allocator's cached blocks handed back first), or the host's available memory."""
    if env.is_cuda:
        env.release_cached()
        return env.mem_get_info()[0], f"{env.device} memory free"
    import psutil

    return psutil.virtual_memory().available, "host memory available"


_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def checkpoint_bytes(model_dir: str, float_itemsize: int) -> int:
    """The weights' bytes once loaded: float tensors at `float_itemsize` bytes per element, other
    tensors (packed quantized blocks, integer scales) as stored. Only the headers are read."""
    total = 0
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            start, end = info["data_offsets"]
            total += numel * float_itemsize if info["dtype"] in _FLOAT_BYTES else end - start
    return total


def draft_cache_share(config: "EngineConfig", device: "torch.device", target_kv_dtype: "torch.dtype") -> Optional[CacheShare]:
    """What the draft model of `config` will take beside the target's KV cache (None without one).
    The draft runs in the dtype rule of the target's device and keeps its cache in the target's
    KV dtype (backend/speculative/draft.py builds it from the same EngineConfig)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    from backend.worker.device import resolve_dtype

    cfg = load_model_config(spec.model)
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype, device, keep_on_cpu=cfg.keeps_dtype_on_cpu)
    return CacheShare(bytes_per_token=kv_bytes_per_token(cfg, target_kv_dtype),
                      reserved_bytes=checkpoint_bytes(spec.model, dtype.itemsize),
                      fixed_tokens=spec.draft_kv_cache_tokens)


def lock_path(identity: str) -> Path:
    folder = Path(os.environ.get(LOCK_DIR_ENV) or tempfile.gettempdir())
    return folder / f"inflight-gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', identity)}.lock"


@contextlib.contextmanager
def one_engine_at_a_time(env: "DeviceEnv") -> Iterator[None]:
    """Hold the GPU's lock (CUDA only) for the block: engines on one GPU load and size one after
    another. The lock is the file's flock, so it is released when the process dies; the file is
    opened read-only, so an engine of another user (a container's uid) can lock it too."""
    if not env.is_cuda:
        yield
        return
    path = lock_path(env.identity())
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another engine is loading on %s (%s): waiting for it to size its KV cache", env.device, path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
