"""The model's fingerprint: what a disk-tier file must have been written for to be loaded. No torch here.

A block's key (backend/kv/block_pool.block_key) names its tokens, not the numbers that computed
its KV: the same tokens under other weights, another dtype or KV dtype, another block size or
another tensor-parallel shard give other bytes. The fingerprint covers all of them, so a file
written by another model or setting is never loaded (backend/kv/tiers/disk.py).

The weights are identified without reading them whole (a checkpoint may be tens of GB): each
safetensors file's size, its header (every tensor's name, dtype, shape and offsets) and three
64 KiB samples of its data (start, middle, end), which tell apart two checkpoints of one shape
(random weights of another seed, a fine-tune) in milliseconds.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Mapping, Sequence

SAMPLE = 1 << 16
FORMAT = 1  # bumped when the host layout of a block changes


def weights_identity(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            h.update(head)
            if len(head) == 8:
                h.update(f.read(struct.unpack("<Q", head)[0]))
            for at in (0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)):
                f.seek(at)
                h.update(f.read(SAMPLE))
    return h.hexdigest()


def model_fingerprint(weight_files: Sequence[Path], config_json: bytes, settings: Mapping[str, Any]) -> bytes:
    """32 bytes over the weights, config.json and `settings` (dtype, KV dtype, block size, the KV
    layout, the tensor-parallel rank and size, the quantization)."""
    blob = json.dumps({"format": FORMAT, "weights": weights_identity(weight_files),
                       "config": hashlib.sha256(config_json).hexdigest(), **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).digest()
