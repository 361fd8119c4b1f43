"""The paged KV cache's bookkeeping: which block belongs to which sequence. No torch here.

The cache is one preallocated pool of `num_blocks` blocks of `block_size` token slots; the model
runner owns the tensors, this class owns the numbers. A sequence's block table lists its blocks in
order; token i of the sequence lives in slot `table[i // block_size] * block_size + i % block_size`.

Blocks carry reference counts so that a block can later be shared between sequences (prefix
reuse); today every owner holds its own blocks and counts are 0 or 1.
"""
from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1; got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

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
        for _ in range(need):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)

    def free(self, seq_id: str) -> None:
        """Give back every block of seq_id (a no-op for an unknown id)."""
        for block in reversed(self._tables.pop(seq_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is either free or owned, never both, never
        leaked, and reference counts equal the number of tables holding each block."""
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(table) == len(set(table)), f"{seq_id} holds a block twice"
            for block in table:
                counts[block] += 1
        for block in range(self.num_blocks):
            assert counts[block] == self._ref_counts[block], f"block {block}: bad reference count"
        free_set = set(free)
        for block in range(self.num_blocks):
            owned = counts[block] > 0
            assert owned != (block in free_set), f"block {block} is {'both owned and free' if owned else 'leaked'}"
