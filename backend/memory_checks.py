"""Sizes checked against the memory there is, before the allocations they set (the KV cache, the
block tables of `max_num_seqs` rows): a size that cannot fit is a ValueError naming the key, the
size asked and the memory available, instead of an allocator's error (or the OOM killer) that
names none. Called by the runner where it allocates (backend/runner.py); the draft model's runner
names its own key (backend/spec/draft.py). On the GPU with `max_tokens_in_paged_kv_cache` 0 the
cache is sized from the free memory (backend/kv_sizing.py) and fits by construction.

No torch at import: `psutil` reads the host's memory; the device's comes from the DeviceEnv.
"""
from __future__ import annotations

from typing import Any

GIB = 2 ** 30


class TooLargeForMemory(ValueError):
    """A configured size does not fit; `detail` is the sizes without the key (for a caller that
    names its own key, such as the draft model's)."""

    def __init__(self, key: str, detail: str):
        super().__init__(f"{key}: {detail}")
        self.key, self.detail = key, detail


def available_bytes(env: Any) -> tuple[int, str]:
    """(bytes available for new allocations, where) on the engine's device: the GPU's free memory
    (its allocator's cached blocks handed back first), or the host's available memory."""
    if env.is_cuda:
        env.release_cached()
        return env.mem_get_info()[0], f"{env.device} memory free"
    import psutil

    return psutil.virtual_memory().available, "host memory available"


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def check_block_tables(config: Any, width: int, env: Any) -> None:
    """The block tables: `max_num_seqs` rows of `width` int32 entries (one per block of the longest
    sequence), on the device."""
    available, where = available_bytes(env)
    tables = config.max_num_seqs * width * 4
    if tables > available:
        raise TooLargeForMemory("max_num_seqs", f"{config.max_num_seqs} sequences' block tables ({width} blocks of "
                                f"{config.kv_block_size} tokens each) take {_size(tables)}; {_size(available)} of {where}")


def check_kv_cache(config: Any, num_blocks: int, bytes_per_block: int, env: Any) -> None:
    """The KV cache, `num_blocks` of `bytes_per_block`, against what the device has free after the
    weights; the error names the key that set its size."""
    available, where = available_bytes(env)
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
