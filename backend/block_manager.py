"""The paged KV cache's bookkeeping: which block belongs to which sequence. No torch here.

The cache is one preallocated pool of `num_blocks` blocks of `block_size` token slots; the model
runner owns the tensors, this class owns the numbers. A sequence's block table lists its blocks in
order; token i of the sequence lives in slot `table[i // block_size] * block_size + i % block_size`.

With prefix caching (`enable_kv_cache_reuse`), every full block is keyed by a hash of its tokens
and of all tokens before it. A new sequence whose prompt starts with cached blocks shares them
(reference counts) instead of recomputing them. A block nobody holds stays cached on the free list
until it is handed out again, least recently freed first.

Listeners (`BlockListener`) hear what enters and leaves the prefix cache (backend/kv_events.py).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Optional, Sequence

from backend.errors import NoFreeBlocksError


ROOT_KEY = b""


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


class BlockListener:
    """Told what enters and leaves the prefix cache (docs/design.md, "KV-cache events"), on the
    engine thread inside the block manager's calls: keep each to an append. Without listeners
    nothing is built. A block manager per KV-cache group would take a listener per group."""

    def blocks_stored(self, blocks: list[int], keys: list[bytes], parent: bytes, root: bytes,
                      token_ids: Sequence[int]) -> None:
        """Consecutive full blocks of one sequence entered the prefix cache: their ids and keys in
        order, the key of the block before the first (`root` when it is the sequence's first
        block), the chain's root (the cache salt: b"" for the base model) and their tokens."""

    def blocks_removed(self, blocks: list[int], keys: list[bytes]) -> None:
        """Cached blocks nobody held are being handed out again: their keys leave the cache. Their
        KV is still intact at this call (the new owner writes it in the next model run)."""

    def cache_cleared(self) -> None:
        """Every key left the prefix cache at once (reset_prefix_cache)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self.num_held = 0  # table entries of every sequence: a block shared by k sequences counts k
        self._block_hash: dict[int, bytes] = {}  # block -> key of its (full) contents
        self._cached: dict[bytes, int] = {}  # key -> block
        self._hashed: dict[str, tuple[int, bytes]] = {}  # seq -> (blocks registered, last key)
        self.listeners: list[BlockListener] = []

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def ref_count(self, block: int) -> int:
        """How many sequences hold the block."""
        return self._ref_counts[block]

    def num_blocks_of(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def extra_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks seq_id must still get so that it can hold num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - self.num_blocks_of(seq_id))

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.extra_blocks_needed(seq_id, num_tokens) <= len(self._free)

    def slot(self, seq_id: str, position: int) -> int:
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # -- mutations ----------------------------------------------------------------------------
    def grow(self, seq_id: str, num_tokens: int) -> None:
        """Make seq_id's table hold at least num_tokens tokens, taking blocks from the free list."""
        need = self.extra_blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise NoFreeBlocksError(f"{seq_id}: needs {need} more blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        evicted: Optional[list[tuple[int, bytes]]] = [] if self.listeners else None
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            key = self._forget_hash(block)  # its old contents are about to be overwritten
            if key is not None and evicted is not None:
                evicted.append((block, key))
            self._ref_counts[block] = 1
            table.append(block)
        self.num_held += need
        if evicted:
            for listener in self.listeners:
                listener.blocks_removed([b for b, _ in evicted], [k for _, k in evicted])

    def free(self, seq_id: str) -> None:
        """Give back every block of seq_id (a no-op for an unknown id)."""
        self._hashed.pop(seq_id, None)
        table = self._tables.pop(seq_id, [])
        self.num_held -= len(table)
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None

    def trim(self, seq_id: str, num_tokens: int) -> int:
        """Give back seq_id's blocks past the first num_tokens tokens (rejected draft tokens' slots);
        returns how many. The table becomes a new list: a block table's list otherwise only grows
        by appending, which is what the runner's device copy counts on (step_inputs.BlockTables)."""
        table = self._tables.get(seq_id)
        keep = self.blocks_for(num_tokens)
        if table is None or len(table) <= keep:
            return 0
        dropped = table[keep:]
        self._tables[seq_id] = table[:keep]
        if self._hashed.get(seq_id, (0,))[0] > keep:  # never for verified tokens: only they are registered
            del self._hashed[seq_id]
        self.num_held -= len(dropped)
        for block in reversed(dropped):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
        return len(dropped)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Share parent's full blocks among its first num_tokens tokens with child, which holds no
        blocks yet (the completions of one prompt). Full blocks are never written again, so sharing
        them is safe. Returns how many tokens child now has computed."""
        if self._tables.get(child_id):
            return 0
        shared = self._tables.get(parent_id, [])[:num_tokens // self.block_size]
        if not shared:
            return 0
        for block in shared:
            self._ref_counts[block] += 1
        self._tables[child_id] = list(shared)
        self.num_held += len(shared)
        return len(shared) * self.block_size

    # -- prefix caching -----------------------------------------------------------------------
    def is_cached_prefix(self, hashes: Sequence[bytes]) -> bool:
        """Is the first block of these keys cached (so reuse_prefix would attach something)?"""
        return bool(hashes) and hashes[0] in self._cached

    def probe_prefix(self, hashes: Sequence[bytes]) -> tuple[int, bool]:
        """What reuse_prefix would attach, without attaching it: (how many of those blocks other
        sequences hold, whether it reaches a cached block nobody holds)."""
        held = 0
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            if self._ref_counts[block] == 0:
                return held, True
            held += 1
        return held, False

    def reuse_prefix(self, seq_id: str, token_ids: Sequence[int] = (), hashes: Optional[Sequence[bytes]] = None) -> int:
        """Attach the longest cached prefix of token_ids to a sequence that holds no blocks yet.
        Returns how many tokens are already computed. The last token is never reused, so the
        sequence always has at least one token to run (its logits give the next token).
        `hashes` in place of token_ids: `block_hashes(token_ids, block_size, len(token_ids) - 1)`,
        kept by a caller that tries the same sequence at every step."""
        if not self.enable_prefix_caching or self._tables.get(seq_id):
            return 0
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size, len(token_ids) - 1)
        if not self.is_cached_prefix(hashes):
            return 0
        table = self._tables.setdefault(seq_id, [])
        last = ROOT_KEY
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
            table.append(block)
            self.num_held += 1
            last = h
        self._hashed[seq_id] = (len(table), last)
        return len(table) * self.block_size

    def register_computed(self, seq_id: str, token_ids: Sequence[int], num_computed: int,
                          root: bytes = ROOT_KEY) -> None:
        """Publish seq_id's newly completed full blocks so later sequences can share them; `root`
        as in block_hashes (the sequence's cache salt)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id, [])
        done, parent = self._hashed.get(seq_id, (0, root))
        full = min(num_computed // self.block_size, len(table))
        bs = self.block_size
        stored: Optional[list[tuple[int, bytes, bytes]]] = [] if self.listeners else None
        for i in range(done, full):
            before = parent
            parent = block_key(parent, token_ids[i * bs:(i + 1) * bs])
            block = table[i]
            if parent not in self._cached and block not in self._block_hash:
                self._cached[parent] = block
                self._block_hash[block] = parent
                if stored is not None:
                    stored.append((i, parent, before))
        if full > done:
            self._hashed[seq_id] = (full, parent)
        if stored:
            self._announce_stored(stored, table, root, token_ids)

    def _announce_stored(self, stored: list[tuple[int, bytes, bytes]], table: list[int], root: bytes,
                         token_ids: Sequence[int]) -> None:
        """Tell the listeners, a run of consecutive blocks at a time (a block whose key another block
        holds is not registered: it breaks the run)."""
        bs, start = self.block_size, 0
        for end in range(1, len(stored) + 1):
            if end == len(stored) or stored[end][0] != stored[end - 1][0] + 1:
                first, last = stored[start][0], stored[end - 1][0]
                for listener in self.listeners:
                    listener.blocks_stored(table[first:last + 1], [k for _, k, _ in stored[start:end]],
                                           stored[start][2], root, token_ids[first * bs:(last + 1) * bs])
                start = end

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key (vLLM's reset_prefix_cache), only while no sequence holds a block,
        so that no held block loses its key. True when done; the listeners hear `cache_cleared`."""
        if self.num_held:
            return False
        self._cached.clear()
        self._block_hash.clear()
        self._hashed.clear()
        for listener in self.listeners:
            listener.cache_cleared()
        return True

    def _forget_hash(self, block: int) -> Optional[bytes]:
        h = self._block_hash.pop(block, None)
        if h is not None:
            del self._cached[h]
        return h

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is either free or owned, never both, never
        leaked, reference counts equal the number of tables holding each block, and the prefix
        cache maps only to blocks that carry that hash."""
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(table) == len(set(table)), f"{seq_id} holds a block twice"
            for block in table:
                counts[block] += 1
        assert self.num_held == sum(counts), f"num_held {self.num_held}, tables hold {sum(counts)}"
        for block in range(self.num_blocks):
            assert counts[block] == self._ref_counts[block], f"block {block}: bad reference count"
            owned = counts[block] > 0
            assert owned != (block in self._free), f"block {block} is {'both owned and free' if owned else 'leaked'}"
        assert len(self._cached) == len(self._block_hash)
        for h, block in self._cached.items():
            assert self._block_hash.get(block) == h, f"prefix cache entry for block {block} is stale"
