"""How many KV-cache blocks fit on the GPU, and one engine sizing at a time per GPU.

With `max_tokens_in_paged_kv_cache` at 0 on CUDA, once the weights are loaded (docs/design.md,
"KV-cache sizing"):
  1. the allocator's unused cached blocks are handed back and the driver's free memory is read:
     `free` (what the weights and every other process left);
  2. the warm-up runs the largest steps the engine can take (a prefill of the whole token budget,
     a decode step of max_num_seqs rows, the sampler on max_num_seqs rows with every option on)
     on a throwaway cache; the allocator's peak above what was allocated before is `activation`;
  3. the cache gets kv_cache_free_gpu_mem_fraction x (free - activation), in whole blocks. With a
     draft model (speculative decoding) that budget is shared (`CacheShare`, from
     backend/spec/draft_sizing.py): the draft's weights, loaded after the target's cache, are set
     aside first, and the rest is split between the two caches by their bytes per token, both
     holding the same number of tokens.
The activation peak is never handed to the cache (the allocator keeps it for the steps), and the
remaining (1 - fraction) x (free - activation) is headroom: the CUDA graphs' memory pool, captured
after the cache, cuBLAS workspaces and the allocator's fragmentation.

Several engines on one GPU (`instance_group { count: 2 }`): Triton loads the instances in
parallel, in separate processes. Each would read the same free memory and take the same share of
it. `one_engine_at_a_time` holds an exclusive lock file per physical GPU (its UUID) around weight
loading, sizing, the cache allocation and graph capture, so the second engine measures what the
first left: with fraction f, the first gets f of the free memory and the second f of the rest.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

if TYPE_CHECKING:  # no torch at import: the sizing rules are plain arithmetic
    from backend.device import DeviceEnv

log = logging.getLogger(__name__)
GIB = 2 ** 30
LOCK_DIR_ENV = "INFLIGHT_LOCK_DIR"   # where the per-GPU lock files go (default: the temp folder)


def kv_bytes_per_token(cfg, dtype) -> int:
    """KV-cache bytes one token takes: K and V, every layer, every kv head."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


@dataclass(frozen=True)
class GpuMemory:
    free: int         # bytes free on the device after the weights (driver's view)
    total: int
    activation: int   # the warm-up's allocation peak above what was allocated before it


def measure(env: "DeviceEnv", warm_up: Callable[[], None]) -> GpuMemory:
    """Free memory before the warm-up and the warm-up's activation peak (steps 1 and 2 above)."""
    env.synchronize()
    env.release_cached()
    free, total = env.mem_get_info()
    before = env.reset_peak()
    warm_up()
    env.synchronize()
    return GpuMemory(free, total, max(0, env.peak_allocated() - before))


@dataclass(frozen=True)
class CacheShare:
    """A second KV cache that shares this one's memory budget: the draft model's."""
    bytes_per_token: int      # its KV bytes per token
    reserved_bytes: int       # what it takes before its cache (its weights), not yet allocated
    fixed_tokens: int = 0     # its cache's size when fixed (draft_kv_cache_tokens); 0: the target's tokens

    def bytes_for(self, target_tokens: int) -> int:
        """Its weights and cache beside a target cache of target_tokens."""
        return self.reserved_bytes + self.bytes_per_token * (self.fixed_tokens or target_tokens)


def blocks_that_fit(mem: GpuMemory, fraction: float, bytes_per_block: int, device: object,
                    share: Optional[CacheShare] = None, block_size: int = 1) -> int:
    """Step 3: fraction x (free - activation), in whole blocks; at least one, or a clear error.
    With a `share` (block_size tokens per block), its weights and fixed cache come off the budget
    first and each target block pays for the share's block_size tokens too."""
    budget = fraction * (mem.free - mem.activation)
    per_block = bytes_per_block
    if share is not None:
        budget -= share.bytes_for(0)
        per_block += 0 if share.fixed_tokens else share.bytes_per_token * block_size
    blocks = int(budget) // per_block
    if blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache on {device}: {mem.free / GIB:.2f} GiB free after the "
            f"weights, of which the largest step's activations take {mem.activation / GIB:.2f} GiB"
            + (f" and the draft model {share.bytes_for(0) / GIB:.2f} GiB" if share else "") +
            f" (kv_cache_free_gpu_mem_fraction {fraction}, {per_block} bytes per block). Lower "
            "max_num_batched_tokens or max_num_seqs, or use a GPU with more free memory")
    log.info("KV cache on %s: %.2f GiB free after the weights, %.2f GiB of activations, %s x the rest "
             "= %d blocks%s", device, mem.free / GIB, mem.activation / GIB, fraction, blocks,
             f" (shared with the draft model: {share.bytes_for(blocks * block_size) / GIB:.2f} GiB)" if share else "")
    return blocks


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
