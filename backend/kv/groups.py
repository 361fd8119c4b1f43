"""KV-cache groups (vLLM's hybrid KV-cache manager): the paged cache kept per group of layers that
attend alike, so that a local (sliding-window) layer's blocks can leave the cache once no query
can see them. No torch here.

`kv_layout` splits a model's layers into groups of equal size: its global layers, and its local
layers of each window, cut into groups as large as the smallest kind (Gemma 3 270M: 3 global and 15
local layers, so one global group and five local ones of 3 layers each). The cache then holds as
many K and V tensors as a group has layers (`slots`), and a layer reads tensor `layer_slot` through
its group's block tables: a block id stands for the same rows of every tensor, so one block of the
pool is one group's `slots` layers of `block_size` tokens, and every group draws from one pool.
Layer k of each group shares tensor k (backend/worker/runner.py allocates them).

`KVCacheGroups` is what the scheduler holds: one `BlockManager` per group (backend/kv/block_manager.py)
over one `BlockPool`, with the block manager's interface summed over the groups. A sequence has a
block table per group; a local group gives back the blocks before each sequence's window after
every step (`slide`), and counts in `blocks_for` only what a sequence can hold at once: its window
and the step's tokens (`max_prefill_tokens` while it prefills, `max_decode_tokens` after). A prefix
hit is the longest that every group accepts (a local group: the blocks its window reaches before
the hit point must still be cached), and the n completions of a prompt share their first one's
blocks only when every local group still holds that window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from backend.kv.block_manager import BlockManager
from backend.kv.block_pool import NULL_BLOCK, ROOT_KEY, BlockPool, PoolCounts, block_hashes
from backend.core.errors import NoFreeBlocksError


@dataclass(frozen=True)
class KVLayout:
    group_windows: tuple[int, ...]  # per group: its layers' sliding window, 0 for global attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: which of the `slots` K/V tensors it reads
    slots: int  # K and V tensors the cache holds: a group's layers (the largest group's)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)


def kv_layout(layer_windows: Sequence[int], num_layers: int) -> KVLayout:
    """The groups of a model whose layer i has sliding window layer_windows[i] (() or 0: global):
    global layers first, each kind's layers in order, groups the size of the smallest kind."""
    windows = list(layer_windows) or [0] * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    kinds = {w: [i for i, x in enumerate(windows) if x == w] for w in sorted(set(windows))}
    size = min(len(layers) for layers in kinds.values())
    group_windows: list[int] = []
    layer_group, layer_slot = [0] * num_layers, [0] * num_layers
    for window, layers in kinds.items():
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


class KVCacheGroups(PoolCounts):
    def __init__(self, num_blocks: int, block_size: int, group_windows: Sequence[int] = (0,),
                 enable_prefix_caching: bool = False, max_prefill_tokens: Optional[int] = None,
                 max_decode_tokens: int = 1, listeners: Sequence = ()):
        """`max_prefill_tokens`: the most tokens a prefill step computes for one sequence
        (max_num_batched_tokens; None: unbounded); `max_decode_tokens`: a decode step's (1 +
        speculative drafts); `listeners`: BlockListeners of the first group's prefix cache (the KV
        tiers, the KV-event collector)."""
        self.pool = BlockPool(num_blocks)
        self.groups = [BlockManager(num_blocks, block_size, enable_prefix_caching, window, self.pool,
                                    max_prefill_tokens, max_decode_tokens) for window in group_windows]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # KV-cache events (backend/kv/events.py) and the KV tiers follow the first group: a model's
        # global layers, whose blocks say where a prefix lives (a local group's come and go with the window)
        self.listeners = self.groups[0].listeners
        self.listeners.extend(listeners)

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return sum(g.num_held for g in self.groups)

    def blocks_for(self, num_tokens: int, decoding: bool = False) -> int:
        """Blocks a sequence of num_tokens tokens holds at most, in all groups; `decoding`: from
        now on it computes at most max_decode_tokens a step (its prompt is computed)."""
        return sum(g.blocks_for(num_tokens, decoding) for g in self.groups)

    def block_table(self, seq_id: str) -> list[int]:
        """The first group's table (the only one of a model whose layers attend alike)."""
        return self.groups[0].block_table(seq_id)

    def block_tables(self, seq_id: str) -> list[list[int]]:
        return [g.block_table(seq_id) for g in self.groups]


    def num_blocks_of(self, seq_id: str) -> int:
        return sum(g.num_blocks_of(seq_id) for g in self.groups)

    def held_blocks(self, seq_id: str) -> list[int]:
        return [b for g in self.groups for b in g.held_blocks(seq_id)]

    def table_tokens(self, seq_id: str) -> int:
        """The positions seq_id's tables reach (given back entries included)."""
        return len(self.groups[0].block_table(seq_id)) * self.block_size

    def extra_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        return sum(g.extra_blocks_needed(seq_id, num_tokens) for g in self.groups)

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.extra_blocks_needed(seq_id, num_tokens) <= len(self.pool.free)

    # -- mutations ------------------------------------------------------------------------------
    def grow(self, seq_id: str, num_tokens: int) -> None:
        """Every group's table holds num_tokens tokens, or nothing changes (NoFreeBlocksError)."""
        need = self.extra_blocks_needed(seq_id, num_tokens)
        if need > len(self.pool.free):
            raise NoFreeBlocksError(f"{seq_id}: needs {need} more blocks, {len(self.pool.free)} free")
        for g in self.groups:
            g.grow(seq_id, num_tokens)

    def free(self, seq_id: str) -> None:
        for g in self.groups:
            g.free(seq_id)

    def trim(self, seq_id: str, num_tokens: int) -> int:
        return sum(g.trim(seq_id, num_tokens) for g in self.groups)

    def slide(self, seq_id: str, num_computed: int) -> int:
        """After a step: the local groups give back seq_id's blocks before its window."""
        return sum(g.slide(seq_id, num_computed) for g in self.groups)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """BlockManager.fork in every group, or in none when a local group no longer holds the
        window of the shared prefix's end (the child then computes the prompt itself)."""
        end = num_tokens // self.block_size
        if any(g.block_table(child_id) for g in self.groups):
            return 0
        if not all(g.shares_window(g.block_table(parent_id)[:end], end) for g in self.groups):
            return 0
        computed = [g.fork(parent_id, child_id, num_tokens) for g in self.groups]
        return computed[0]

    def adopt(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """BlockManager.adopt in every group (beam search's copy-on-write); the copies to make."""
        return [c for g in self.groups for c in g.adopt(parent_id, child_id, num_tokens)]

    def attach(self, seq_id: str, entries: Sequence[Sequence[Optional[int]]]) -> list[list[int]]:
        """Extend seq_id's table in every group by that group's entries (BlockManager.extend): the
        cached blocks named are held first, in every group, so that no block taken after evicts
        them; then each None takes a block. Returns each group's blocks taken, in order (a prefix
        found in the KV tiers: backend/kv/tiers/grouped.py)."""
        for group in entries:
            for block in group:
                if block is not None and block != NULL_BLOCK:
                    self.pool.hold(block)
        evicted = self.pool.evictions()
        taken = [g.extend(seq_id, e, evicted) for g, e in zip(self.groups, entries)]
        self.pool.announce(evicted)
        return taken

    # -- prefix caching -------------------------------------------------------------------------
    def prefix_hit(self, hashes: Sequence[bytes]) -> int:
        """The most leading blocks every group may take from the cache. A local group's answer at
        one length says nothing of a shorter one, so the groups are asked again until they agree."""
        length, settled = len(hashes), False
        while not settled:
            settled = True
            for g in self.groups:
                hit = g.prefix_hit(hashes, length)
                if hit < length:
                    length, settled = hit, False
        return length

    def probe_prefix(self, hashes: Sequence[bytes]) -> tuple[int, bool]:
        length = self.prefix_hit(hashes)
        probes = [g.probe_prefix(hashes, length) for g in self.groups]
        return sum(held for held, _ in probes), any(free for _, free in probes)

    def reuse_prefix(self, seq_id: str, token_ids: Sequence[int] = (), hashes: Optional[Sequence[bytes]] = None) -> int:
        """BlockManager.reuse_prefix with the hit every group accepts."""
        if not self.enable_prefix_caching or any(g.block_table(seq_id) for g in self.groups):
            return 0
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size, len(token_ids) - 1)
        length = self.prefix_hit(hashes)
        if length == 0:
            return 0
        return [g.reuse_prefix(seq_id, hashes=hashes, length=length) for g in self.groups][0]

    def register_computed(self, seq_id: str, token_ids, num_computed: int,
                          root: bytes = ROOT_KEY) -> None:
        for g in self.groups:
            g.register_computed(seq_id, token_ids, num_computed, root)

    def reset_prefix_cache(self) -> bool:
        """BlockManager.reset_prefix_cache in every group, only while no sequence holds a block."""
        return not self.num_held and all([g.reset_prefix_cache() for g in self.groups])

    # -- invariants -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every group's checks and the pool's (BlockManager.check_integrity), and every sequence's
        tables alike long in every group."""
        self.groups[0].check_integrity()
        for seq_id in self.groups[0]._tables:
            lengths = {len(g.block_table(seq_id)) for g in self.groups}
            assert len(lengths) == 1, f"{seq_id}: tables of different lengths per group {lengths}"
        for g in self.groups[1:]:
            assert set(g._tables) == set(self.groups[0]._tables), "a sequence holds tables in some groups only"
