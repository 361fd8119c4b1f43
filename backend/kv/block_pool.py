"""The KV cache's blocks as numbers (no torch here): the pool every KV-cache group's block manager
takes them from (`BlockPool`: the free list, least recently freed first, and each block's reference
count), and the prefix cache's keys (`block_key`, `block_hashes`). backend/kv/block_manager.py keeps
the tables.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Optional, Sequence

ROOT_KEY = b""
NULL_BLOCK = -1  # a table entry whose block left the sequence's window and was given back


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's prefix-cache key: sha256 over its parent's key and its token ids. Python's
    hash() of a tuple is 64 bits and unkeyed, so a crafted collision could hand one request
    another's KV (vLLM moved to sha256 after CVE-2025-25183)."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, limit: Optional[int] = None,
                 root: bytes = ROOT_KEY) -> list[bytes]:
    """Chained keys of the full blocks among the first `limit` tokens. `root` starts the chain: a
    request's `cache_salt` (its LoRA adapter's), so equal tokens under different weights never
    share a key."""
    n = len(token_ids) if limit is None else min(limit, len(token_ids))
    hashes, parent = [], root
    for start in range(0, n - n % block_size, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """The cache's blocks, shared by the block managers of every KV-cache group: the free list (least
    recently freed first: the prefix cache's eviction order) and each block's reference count."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"need num_blocks >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.managers: list = []  # the BlockManagers on the pool: each keeps a prefix cache that may name a block

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def take(self, evicted: Optional[list] = None) -> int:
        """A free block for a new owner; whichever prefix cache named it forgets it (its contents
        are about to be overwritten), noted in `evicted` as (manager, block, key) when given."""
        block, _ = self.free.popitem(last=False)
        for manager in self.managers:
            key = manager._forget_hash(block)
            if key is not None and evicted is not None:
                evicted.append((manager, block, key))
        self.ref_counts[block] = 1
        return block

    def evictions(self) -> Optional[list]:
        """A list for `take` to note evictions in, when some manager has listeners to tell."""
        return [] if any(m.listeners for m in self.managers) else None

    def announce(self, evicted: Optional[list]) -> None:
        """Tell each manager's listeners the keys that left its cache (BlockListener.blocks_removed)."""
        for manager in self.managers:
            mine = [(block, key) for owner, block, key in evicted or () if owner is manager]
            if mine:
                manager._announce_removed(mine)

    def hold(self, block: int) -> None:
        """One more holder of a block (a cached one nobody held leaves the free list)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None


class PoolCounts:
    """The pool's counts, as a block manager and the KV-cache groups (backend/kv/groups.py) both
    report them (what the scheduler and the metrics read)."""
    pool: BlockPool

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def ref_count(self, block: int) -> int:
        """How many sequences hold the block."""
        return self.pool.ref_counts[block]
