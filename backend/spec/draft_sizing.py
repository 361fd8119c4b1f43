"""The draft model's share of the GPU's memory, known before the target sizes its KV cache.

A draft model (speculative_config method draft_model) keeps a KV cache of its own beside the
target's, holding the same sequences: as many tokens as the target's cache (or
`draft_kv_cache_tokens`). Sized one after the other, the target would take
kv_cache_free_gpu_mem_fraction of the free memory and leave the draft what the headroom holds:
for Qwen2.5-0.5B drafting for Qwen2.5-7B the draft's cache needs 21% of the target's bytes, for
Llama-3.2-1B drafting for Llama-3.1-8B 25%, and the draft's weights come on top. So the target
sizes for both (backend/kv_sizing.py `blocks_that_fit` with this share): the draft's weights
(read from its safetensors headers, in the dtype the draft will run) are set aside, and the budget
left is split between the two caches by their bytes per token.
"""
from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Optional

from backend.kv_sizing import CacheShare, kv_bytes_per_token
from backend.loader import load_model_config, weight_files

if TYPE_CHECKING:
    import torch

    from backend.config import EngineConfig

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
    KV dtype (backend/spec/draft.py builds it from the same EngineConfig)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    from backend.device import resolve_dtype

    cfg = load_model_config(spec.model)
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype, device)
    return CacheShare(bytes_per_token=kv_bytes_per_token(cfg, target_kv_dtype),
                      reserved_bytes=checkpoint_bytes(spec.model, dtype.itemsize),
                      fixed_tokens=spec.draft_kv_cache_tokens)


def describe(share: CacheShare) -> str:
    return (f"draft model: {share.reserved_bytes / 2**30:.2f} GiB of weights, {share.bytes_per_token} KV bytes per token"
            + (f", {share.fixed_tokens} tokens fixed" if share.fixed_tokens else ", as many tokens as the target"))


__all__ = ["CacheShare", "checkpoint_bytes", "draft_cache_share", "describe"]
