"""The prefix cache of one KV-cache group's block manager (`PrefixCache`, a part of BlockManager:
backend/kv/block_manager.py keeps the tables). No torch here.

With prefix caching (`enable_kv_cache_reuse`), every full block is keyed by a hash of its tokens
and of all tokens before it (backend/kv/block_pool.py's `block_key`). A new sequence whose prompt
starts with cached blocks shares them (reference counts) instead of recomputing them. A block
nobody holds stays cached on the free list until it is handed out again, least recently freed
first (a block a local group gave back too: another sequence with the same prefix may find it).

Listeners (`BlockListener`) hear what enters and leaves the prefix cache (backend/kv/events.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

from backend.kv.block_pool import NULL_BLOCK, ROOT_KEY, block_hashes, block_key


class BlockListener:
    """Told what enters and leaves the prefix cache (docs/design.md, "KV-cache events"), on the
    engine thread inside the block manager's calls: keep each to an append. Without listeners
    nothing is built. The KV-cache groups (backend/kv/groups.py) attach listeners to their first
    group: a model's global layers, whose blocks say where a prefix lives."""

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


class PrefixCache:
    """The prefix-cache half of a BlockManager: it reads the manager's pool, tables, window and
    block size, and keeps the keys (`_cached`, `_block_hash`), how far each sequence registered
    (`_hashed`) and the listeners."""

    def _init_prefix_cache(self) -> None:
        self._block_hash: dict[int, bytes] = {}  # block -> key of its (full) contents
        self._cached: dict[bytes, int] = {}  # key -> block
        self._hashed: dict[str, tuple[int, bytes]] = {}  # seq -> (blocks registered, last key)
        self.listeners: list[BlockListener] = []

    def prefix_hit(self, hashes: Sequence[bytes], limit: int) -> int:
        """The most blocks, at most `limit`, that a sequence of these keys may take from the cache:
        a global group, the cached run from the first key; a local group, the longest prefix whose
        window's blocks (`window_blocks` before its end) are all cached, the blocks before them
        left out (vLLM's sliding-window hit). Scanned from the right: the first run found is the
        longest."""
        limit = min(limit, len(hashes))
        if not self.window:
            n = 0
            while n < limit and hashes[n] in self._cached:
                n += 1
            return n
        need, run = self.window_blocks(), 0
        if need == 0:
            return limit
        for i in range(limit - 1, -1, -1):
            if hashes[i] not in self._cached:
                run = 0
                continue
            run += 1
            if run >= need or i == 0:
                return i + run
        return 0

    def cached_block(self, key: bytes) -> Optional[int]:
        """The block the cache holds under key (None: none)."""
        return self._cached.get(key)

    def prefix_blocks(self, hashes: Sequence[bytes], length: int) -> list[int]:
        """The cached blocks a hit of `length` blocks attaches (a local group: its window's only)."""
        first = max(0, length - self.window_blocks()) if self.window else 0
        return [self._cached[h] for h in hashes[first:length]]

    def probe_prefix(self, hashes: Sequence[bytes], length: Optional[int] = None) -> tuple[int, bool]:
        """What reuse_prefix would attach (a hit of `length` blocks; default its own longest),
        without attaching it: (how many of those blocks other sequences hold, whether it reaches
        a cached block nobody holds)."""
        if length is None:
            length = self.prefix_hit(hashes, len(hashes))
        counts = [self.pool.ref_counts[b] for b in self.prefix_blocks(hashes, length)]
        return sum(c > 0 for c in counts), 0 in counts

    def reuse_prefix(self, seq_id: str, token_ids: Sequence[int] = (), hashes: Optional[Sequence[bytes]] = None,
                     length: Optional[int] = None) -> int:
        """Attach the longest cached prefix of token_ids (or one of `length` blocks, which must be
        a hit) to a sequence that holds no blocks yet. Returns how many tokens are already computed.
        The last token is never reused, so the sequence always has at least one token to run (its
        logits give the next token). `hashes` in place of token_ids: `block_hashes(token_ids,
        block_size, len(token_ids) - 1)`, kept by a caller that tries the same sequence at every
        step."""
        if not self.enable_prefix_caching or self._tables.get(seq_id):
            return 0
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size, len(token_ids) - 1)
        if length is None:
            length = self.prefix_hit(hashes, len(hashes))
        if length == 0:
            return 0
        blocks = self.prefix_blocks(hashes, length)
        for block in blocks:
            self.pool.hold(block)
        self._tables[seq_id] = [NULL_BLOCK] * (length - len(blocks)) + blocks
        self.num_held += len(blocks)
        self._hashed[seq_id] = (length, hashes[length - 1])
        return length * self.block_size

    def register_computed(self, seq_id: str, token_ids, num_computed: int, root: bytes = ROOT_KEY) -> None:
        """Publish seq_id's newly completed full blocks so later sequences can share them; `root`
        as in block_hashes (the sequence's cache salt). `token_ids`: its tokens, a list or a
        sequence's TokenSequence (core/tokens.py: sliced only when a block completes)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq_id, [])
        done, parent = self._hashed.get(seq_id, (0, root))
        full = min(num_computed // self.block_size, len(table))
        if full <= done:
            return
        if hasattr(token_ids, "token_ids"):
            token_ids = token_ids.token_ids(0, full * self.block_size)
        bs = self.block_size
        stored: Optional[list[tuple[int, bytes, bytes]]] = [] if self.listeners else None
        for i in range(done, full):
            before = parent
            parent = block_key(parent, token_ids[i * bs:(i + 1) * bs])
            block = table[i]
            if block != NULL_BLOCK and parent not in self._cached and block not in self._block_hash:
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
        """The block is handed out again: its key (if it had one here) leaves the cache."""
        h = self._block_hash.pop(block, None)
        if h is not None:
            del self._cached[h]
        return h

    def _announce_removed(self, evicted: list[tuple[int, bytes]]) -> None:
        for listener in self.listeners:
            listener.blocks_removed([b for b, _ in evicted], [k for _, k in evicted])

