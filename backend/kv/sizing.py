"""KV-cache sizing, the one place of it: how many blocks fit, a draft model's share, and every
configured size checked against the memory there is. Plain arithmetic on numbers the worker reads
off the device (backend/worker/memory.py): no torch, no device here.

With `max_tokens_in_paged_kv_cache` at 0 on CUDA, once the weights are loaded (docs/design.md,
"KV-cache sizing"):
  1. the allocator's unused cached blocks are handed back and the driver's free memory is read:
     `free` (what the weights and every other process left);
  2. the warm-up runs the largest steps the engine can take (a prefill of the whole token budget,
     a decode step of max_num_seqs rows, the sampler on max_num_seqs rows with every option on)
     on a throwaway cache; the allocator's peak above what was allocated before is `activation`;
  3. the cache gets kv_cache_free_gpu_mem_fraction x (free - activation), in whole blocks. With a
     draft model (speculative decoding) that budget is shared (`CacheShare`, built by
     backend/worker/memory.py `draft_cache_share`): the draft's weights, loaded after the target's cache, are set
     aside first, and the rest is split between the two caches by their bytes per token, both
     holding the same number of tokens.
The activation peak is never handed to the cache (the allocator keeps it for the steps), and the
remaining (1 - fraction) x (free - activation) is headroom: the CUDA graphs' memory pool, captured
after the cache, cuBLAS workspaces and the allocator's fragmentation.

Several engines on one GPU (`instance_group { count: 2 }`): Triton loads the instances in
parallel, in separate processes. Each would read the same free memory and take the same share of
it. `one_engine_at_a_time` (backend/worker/memory.py) holds an exclusive lock file per physical GPU (its UUID) around weight
loading, sizing, the cache allocation and graph capture, so the second engine measures what the
first left: with fraction f, the first gets f of the free memory and the second f of the rest.

Sizes checked before the allocations they set (the KV cache, the block tables of `max_num_seqs`
rows, the draft's cache): a size that cannot fit is a ValueError naming the key, the size asked and
the memory available, instead of an allocator's error (or the OOM killer) that names none. On the
GPU with `max_tokens_in_paged_kv_cache` 0 the cache is sized from the free memory and fits by
construction.

A draft model (speculative_config method draft_model) keeps a KV cache of its own beside the
target's, holding the same sequences: as many tokens as the target's cache (or
`draft_kv_cache_tokens`). Sized one after the other, the target would take
kv_cache_free_gpu_mem_fraction of the free memory and leave the draft what the headroom holds: for
Qwen2.5-0.5B drafting for Qwen2.5-7B the draft's cache needs 21% of the target's bytes, for
Llama-3.2-1B drafting for Llama-3.1-8B 25%, and the draft's weights come on top. So the target
sizes for both (`blocks_that_fit` with a `CacheShare`): the draft's weights are set aside, and the
budget left is split between the two caches by their bytes per token.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)
GIB = 2 ** 30
Available = tuple[int, str]  # (bytes free for new allocations, where: "host memory available", ...)


def kv_bytes_per_token(cfg, dtype) -> int:
    """KV-cache bytes one token takes: K and V, every layer, every kv head."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


@dataclass(frozen=True)
class GpuMemory:
    free: int         # bytes free on the device after the weights (driver's view)
    total: int
    activation: int   # the warm-up's allocation peak above what was allocated before it


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


def describe(share: CacheShare) -> str:
    return (f"draft model: {share.reserved_bytes / 2**30:.2f} GiB of weights, {share.bytes_per_token} KV bytes per token"
            + (f", {share.fixed_tokens} tokens fixed" if share.fixed_tokens else ", as many tokens as the target"))


class TooLargeForMemory(ValueError):
    """A configured size does not fit; `detail` is the sizes without the key (for a caller that
    names its own key, such as the draft model's)."""

    def __init__(self, key: str, detail: str):
        super().__init__(f"{key}: {detail}")
        self.key, self.detail = key, detail


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def check_block_tables(config: Any, width: int, available: Available, groups: int = 1) -> None:
    """The block tables: `max_num_seqs` rows of `width` int32 entries (one per block of the longest
    sequence) for each of the `groups` KV-cache groups (backend/kv/groups.py), on the device."""
    available, where = available
    tables = groups * config.max_num_seqs * width * 4
    if tables > available:
        per = f" in each of {groups} KV-cache groups" if groups > 1 else ""
        raise TooLargeForMemory("max_num_seqs", f"{config.max_num_seqs} sequences' block tables ({width} blocks of "
                                f"{config.kv_block_size} tokens each{per}) take {_size(tables)}; "
                                f"{_size(available)} of {where}")


def check_kv_cache(config: Any, num_blocks: int, bytes_per_block: int, available: Available) -> None:
    """The KV cache, `num_blocks` of `bytes_per_block`, against what the device has free after the
    weights; the error names the key that set its size."""
    available, where = available
    kv = num_blocks * bytes_per_block
    if kv <= available:
        return
    block_size = config.kv_block_size
    if num_blocks == 1:  # the block alone is too large: kv_block_size is what to change
        key, asked = "kv_block_size", f"one block of {block_size} tokens"
    elif config.max_tokens_in_paged_kv_cache > 0:
        key, asked = "max_tokens_in_paged_kv_cache", f"{config.max_tokens_in_paged_kv_cache} tokens"
    else:
        key, asked = "cpu_kv_cache_tokens", f"{config.cpu_kv_cache_tokens} tokens"
    raise TooLargeForMemory(key, f"{asked} of KV cache ({num_blocks} blocks of {block_size} tokens) take {_size(kv)}; "
                                 f"{_size(available)} of {where} after the weights: lower it")
