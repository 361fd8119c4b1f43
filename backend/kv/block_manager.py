"""The paged KV cache's bookkeeping: which block belongs to which sequence. No torch here.

The cache is one preallocated pool of `num_blocks` blocks of `block_size` token slots (`BlockPool`:
the free list and each block's reference count); the model runner owns the tensors, this module
owns the numbers. A sequence's block table lists its blocks in order; token i of the sequence lives
in slot `table[i // block_size] * block_size + i % block_size`.

A `BlockManager` keeps the tables of one KV-cache group: layers that attend alike. A model whose
layers differ (Gemma 3: local sliding-window layers beside global ones) has one manager per group,
all over one pool (backend/kv/groups.py composes them). A group of local layers with a `window`
needs only each sequence's last `window` tokens: `slide` gives back the blocks that fell wholly
out of it, their table entries becoming `NULL_BLOCK`.

Each manager keeps its group's prefix cache (backend/kv/prefix_cache.py: `enable_kv_cache_reuse`).
"""
from __future__ import annotations

from typing import Optional, Sequence

from backend.kv.block_pool import NULL_BLOCK, ROOT_KEY, BlockPool, PoolCounts, block_hashes, block_key
from backend.core.errors import NoFreeBlocksError
from backend.kv.prefix_cache import BlockListener, PrefixCache

__all__ = ["BlockListener", "BlockManager", "BlockPool", "NULL_BLOCK", "ROOT_KEY", "block_hashes", "block_key"]


class BlockManager(PoolCounts, PrefixCache):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 window: int = 0, pool: Optional[BlockPool] = None, max_prefill_tokens: Optional[int] = None,
                 max_decode_tokens: int = 1):
        """One group's tables over `pool` (a pool of its own, of `num_blocks`, when none is given).
        `window` > 0: the group's layers attend to a sequence's last `window` tokens only; a step
        computes at most `max_prefill_tokens` of a sequence's tokens while it prefills (None:
        unbounded) and `max_decode_tokens` after (blocks_for). Alone, it is what the scheduler
        holds for a model whose layers attend alike (backend/kv/groups.py has the same interface)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        self.pool = pool or BlockPool(num_blocks)
        self.pool.managers.append(self)
        self.num_blocks = self.pool.num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.max_prefill_tokens = max_prefill_tokens
        self.max_decode_tokens = max_decode_tokens
        self._tables: dict[str, list[int]] = {}
        self.num_held = 0  # table entries of every sequence: a block shared by k sequences counts k
        self._init_prefix_cache()

    # -- queries ------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int, decoding: bool = False) -> int:
        """Blocks a sequence of num_tokens tokens holds at most; `decoding`: its prompt is computed
        (steps of at most max_decode_tokens from now on). A window caps it: a step of c new tokens
        reads the window - 1 tokens before them, and any span of s tokens lies in at most
        ceil((s - 1) / block_size) + 1 blocks (each step's `slide` having given back those before)."""
        whole = -(-num_tokens // self.block_size)
        chunk = self.max_decode_tokens if decoding else self.max_prefill_tokens
        if not self.window or chunk is None:
            return whole
        span = self.window - 1 + min(chunk, num_tokens)
        return min(whole, -(-(span - 1) // self.block_size) + 1)

    def block_table(self, seq_id: str) -> list[int]:
        return self._tables.get(seq_id, [])

    def table_tokens(self, seq_id: str) -> int:
        """The positions seq_id's table reaches (given-back entries included)."""
        return len(self._tables.get(seq_id, ())) * self.block_size

    def num_blocks_of(self, seq_id: str) -> int:
        """Blocks seq_id holds (a slid-out entry holds none)."""
        return sum(b != NULL_BLOCK for b in self._tables.get(seq_id, ()))

    def held_blocks(self, seq_id: str) -> list[int]:
        return [b for b in self._tables.get(seq_id, ()) if b != NULL_BLOCK]

    def extra_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks seq_id must still get so that it can hold num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(self._tables.get(seq_id, ())))

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.extra_blocks_needed(seq_id, num_tokens) <= len(self.pool.free)

    def slot(self, seq_id: str, position: int) -> int:
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # -- mutations ----------------------------------------------------------------------------
    def grow(self, seq_id: str, num_tokens: int) -> None:
        """Make seq_id's table hold at least num_tokens tokens, taking blocks from the free list."""
        need = self.extra_blocks_needed(seq_id, num_tokens)
        if need > len(self.pool.free):
            raise NoFreeBlocksError(f"{seq_id}: needs {need} more blocks, {len(self.pool.free)} free")
        table = self._tables.setdefault(seq_id, [])
        evicted = self.pool.evictions()
        for _ in range(need):
            table.append(self.pool.take(evicted))
        self.num_held += need
        self.pool.announce(evicted)

    def free(self, seq_id: str) -> None:
        """Give back every block of seq_id (a no-op for an unknown id)."""
        self._hashed.pop(seq_id, None)
        self._release(reversed(self._tables.pop(seq_id, [])))

    def _release(self, blocks) -> int:
        """Give back table entries (the tail first frees the tail first); returns the blocks."""
        released = 0
        for block in blocks:
            if block != NULL_BLOCK:
                self.pool.release(block)
                released += 1
        self.num_held -= released
        return released

    def slide(self, seq_id: str, num_computed: int) -> int:
        """A local group: give back seq_id's blocks wholly before the window of its next token
        (position num_computed sees num_computed - window + 1 on); returns how many."""
        table = self._tables.get(seq_id)
        if not self.window or not table:
            return 0
        end = min(max(0, num_computed - self.window + 1) // self.block_size, len(table))
        dropped = []
        for i in range(end - 1, -1, -1):  # from the window's edge back to the last one given back
            if table[i] == NULL_BLOCK:
                break
            dropped.append(table[i])
            table[i] = NULL_BLOCK
        return self._release(dropped)

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
        return self._release(reversed(dropped))

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Share parent's full blocks among its first num_tokens tokens with child, which holds no
        blocks yet (the completions of one prompt). Full blocks are never written again, so sharing
        them is safe. A local group shares them only when parent still holds the window before
        them (`shares_window`); the entries before it stay NULL_BLOCK. Returns how many tokens
        child now has computed."""
        if self._tables.get(child_id):
            return 0
        shared = self._tables.get(parent_id, [])[:num_tokens // self.block_size]
        if not shared or not self.shares_window(shared, len(shared)):
            return 0
        for block in shared:
            if block != NULL_BLOCK:
                self.pool.hold(block)
        self._tables[child_id] = list(shared)
        self.num_held += sum(b != NULL_BLOCK for b in shared)
        return len(shared) * self.block_size

    def adopt(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Beam search: child_id gives back its blocks and takes parent_id's first num_tokens tokens,
        copy-on-write: parent's full blocks shared (one more reference each), its partly filled last
        block copied into a block of child's own, which child writes next. Returns the copies to
        make, (source, destination), before the next step writes."""
        parent = self._tables.get(parent_id, [])
        full, part = divmod(num_tokens, self.block_size)
        self._release(reversed(self._tables.pop(child_id, [])))
        table = list(parent[:full])
        for block in table:
            if block != NULL_BLOCK:
                self.pool.hold(block)
        self.num_held += sum(b != NULL_BLOCK for b in table)
        copies = []
        if part:
            evicted = self.pool.evictions()
            table.append(self.pool.take(evicted))
            self.num_held += 1
            self.pool.announce(evicted)
            copies.append((parent[full], table[-1]))
        self._tables[child_id] = table
        hashed = self._hashed.get(parent_id)
        if hashed is not None and hashed[0] <= full:
            self._hashed[child_id] = hashed
        else:
            self._hashed.pop(child_id, None)
        return copies

    def extend(self, seq_id: str, entries: Sequence[Optional[int]], evicted: Optional[list] = None) -> list[int]:
        """Append entries to seq_id's table (a new list): a cached block, already held by the
        caller (backend/kv/groups.py `attach_hit`), None for a block taken now (returned in order,
        evictions noted in `evicted`), NULL_BLOCK for a position before the window of the new end.
        A local group then gives back its blocks before that window."""
        table = list(self._tables.get(seq_id, ()))
        taken = []
        for entry in entries:
            if entry is None:
                entry = self.pool.take(evicted)
                taken.append(entry)
            table.append(entry)
        self.num_held += sum(b != NULL_BLOCK for b in entries)  # (None: a block taken)
        if self.window:
            cut = max(0, len(table) * self.block_size - self.window + 1) // self.block_size
            self._release([b for b in table[:cut] if b != NULL_BLOCK])
            table[:cut] = [NULL_BLOCK] * cut
        self._tables[seq_id] = table
        return taken

    def window_blocks(self) -> int:
        """The blocks before a position that its window reaches back into (0: all of them)."""
        return -(-(self.window - 1) // self.block_size) if self.window else 0

    def shares_window(self, table: Sequence[int], end: int) -> bool:
        """Whether table holds every block the window of position end * block_size reaches into."""
        if not self.window:
            return NULL_BLOCK not in table[:end]
        return NULL_BLOCK not in table[max(0, end - self.window_blocks()):end]

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is either free or owned, never both, never
        leaked, reference counts equal the number of tables holding each block (of every group on
        the pool), a local group holds no block before a sequence's window start, and the prefix
        cache maps only to blocks that carry that hash."""
        counts = [0] * self.num_blocks
        for manager in self.pool.managers:
            held = manager._check_tables()
            for block in held:
                counts[block] += 1
        for block in range(self.num_blocks):
            assert counts[block] == self.pool.ref_counts[block], f"block {block}: bad reference count"
            owned = counts[block] > 0
            assert owned != (block in self.pool.free), (
                f"block {block} is {'both owned and free' if owned else 'leaked'}")

    def _check_tables(self) -> list[int]:
        """This group's own checks; every block its tables hold."""
        held = []
        for seq_id, table in self._tables.items():
            blocks = [b for b in table if b != NULL_BLOCK]
            assert len(blocks) == len(set(blocks)), f"{seq_id} holds a block twice"
            if self.window:  # slid-out entries only before held ones: one run of NULL_BLOCK first
                first = next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))
                assert NULL_BLOCK not in table[first:], f"{seq_id} has a hole in its window"
            else:
                assert len(blocks) == len(table), f"{seq_id}: a global group gave back a block"
            held += blocks
        assert self.num_held == len(held), f"num_held {self.num_held}, tables hold {len(held)}"
        assert len(self._cached) == len(self._block_hash)
        for h, block in self._cached.items():
            assert self._block_hash.get(block) == h, f"prefix cache entry for block {block} is stale"
        return held
