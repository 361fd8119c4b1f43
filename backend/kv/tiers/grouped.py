"""The KV tiers over several KV-cache groups (backend/kv/groups.py: Gemma 3's sliding-window layers
beside its global ones). No torch here.

A pool block holds one group's layers, so the tiers keep each group's blocks under a key of their
own: the prefix-cache key for the first group (a model of one group keeps its keys, and its disk
files), and that key hashed with the group's index for the others (`group_key`). `GroupListener`
gives a group's prefix-cache events to the tiers under those keys.

A prefix found in the tiers (`tiered_hit`) reaches position `end` (in blocks) when the first group
has every block from the request's device prefix to `end`, and each local group the blocks its
window reaches before `end`; each of those blocks may still be cached on the device (it is then
shared, as a device prefix is) or be held by the host or disk tier (it is copied back). A local
group's blocks before that window are never needed: they are not loaded. The load is whole or
nothing: a part of it would leave a local group without its window (a disk file that fails its
checks sends the request back to its device prefix, backend/sched/tier_admission.py); where too
few host slots are left to stage its disk blocks, a shorter hit (`max_end`) brings its own windows.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from backend.kv.block_manager import NULL_BLOCK
from backend.kv.prefix_cache import BlockListener

GROUP_SALT = b"inflight-kv-group"


def group_key(key: bytes, group: int) -> bytes:
    """The tiers' key of a block of `group` whose prefix-cache key is `key` (32 bytes, as a disk
    file's header holds it)."""
    if group == 0:
        return key
    return hashlib.sha256(GROUP_SALT + group.to_bytes(2, "little") + key).digest()


class GroupListener(BlockListener):
    """A group's prefix-cache events, told to the tiers under that group's keys."""

    def __init__(self, tiers: BlockListener, group: int):
        self.tiers, self.group = tiers, group

    def blocks_stored(self, blocks, keys, parent, root, token_ids) -> None:
        self.tiers.blocks_stored(blocks, [group_key(k, self.group) for k in keys], group_key(parent, self.group),
                                 root, token_ids)

    def blocks_removed(self, blocks, keys) -> None:
        self.tiers.blocks_removed(blocks, [group_key(k, self.group) for k in keys])

    def cache_cleared(self) -> None:
        self.tiers.cache_cleared()


@dataclass
class TieredHit:
    """A prefix reaching `end` blocks, from the device prefix's `start`: per group, the table
    entries from `start` to `end` (a cached device block, None for one to load, NULL_BLOCK before a
    local window), and the loads in position order: their tiers' keys and where (True: on disk)."""
    start: int
    end: int
    entries: list[list[Optional[int]]]
    keys: list[bytes] = field(default_factory=list)
    from_disk: list[bool] = field(default_factory=list)
    first_group: list[Optional[bool]] = field(default_factory=list)  # per position: None on device, else from_disk


def tiered_hit(groups, seq_id: str, hashes: Sequence[bytes], start: int,
               where: Callable[[bytes], Optional[bool]], max_end: Optional[int] = None) -> Optional[TieredHit]:
    """The longest prefix past seq_id's device prefix (`start` blocks, attached), ending at most at
    `max_end`, that the device's caches and the tiers hold together (the module's docstring);
    `where(key)`: None when no tier holds key, False in host memory, True on disk. None when no tier
    block would be loaded."""
    managers = groups.groups
    if max_end is not None:
        hashes = hashes[:max_end]

    def source(g: int, i: int) -> tuple[Optional[int], Optional[bool]]:
        """(cached device block, None) or (None, where a tier holds it) or (None, None)."""
        block = managers[g].cached_block(hashes[i])
        if block is not None:
            return block, None
        return None, where(group_key(hashes[i], g))

    reach, first = start, []
    while reach < len(hashes):
        block, disk = source(0, reach)
        if block is None and disk is None:
            break
        first.append((block, disk))
        reach += 1
    known: dict[tuple[int, int], tuple[Optional[int], Optional[bool]]] = {}  # (group, position): source

    def held(g: int, i: int) -> bool:
        """Whether local group g can give position i: its window before `start` is attached (the
        device prefix), the rest comes from its cache or a tier (asked once, when first needed)."""
        if i < start:
            table = managers[g].block_table(seq_id)
            return i < len(table) and table[i] != NULL_BLOCK
        if (g, i) not in known:
            known[(g, i)] = source(g, i)
        return known[(g, i)] != (None, None)

    end = next((e for e in range(reach, start, -1)
                if all(held(g, i) for g, m in enumerate(managers[1:], 1) for i in range(max(0, e - m.window_blocks()), e))),
               None)
    if end is None:
        return None
    hit = TieredHit(start, end, [[] for _ in managers])
    loads = []
    for i in range(start, end):
        for g, manager in enumerate(managers):
            if g and i < end - manager.window_blocks():
                hit.entries[g].append(NULL_BLOCK)
                continue
            block, disk = first[i - start] if g == 0 else known[(g, i)]
            hit.entries[g].append(block)
            if block is None:
                loads.append((group_key(hashes[i], g), disk))
            if g == 0:
                hit.first_group.append(None if block is not None else disk)
    if not loads:
        return None
    hit.keys = [k for k, _ in loads]
    hit.from_disk = [d for _, d in loads]
    return hit
