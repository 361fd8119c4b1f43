"""What the host pool's slots and the disk tier's files hold, least recently used first. No torch here.

Both tiers are keyed by the prefix cache's chained block keys (backend/kv/block_pool.block_key), so
a key names one block's KV for one model: the same key is the same contents wherever it lies.

A host slot is in exactly one state:
- free: on the free list, no key, no pin;
- keyed: it holds a block's KV under a key (a hit serves it; the LRU may give it away when unpinned);
- staged: taken and pinned with no key yet (a disk read landing in it, or a read that failed and
  waits for its copy to be given up); back on the free list when its last pin goes.
A pin is a copy in flight that reads or writes the slot (a device copy, a disk read or write): a
pinned slot is never given away, so bytes are never overwritten under a copy.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Optional


class HostIndex:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._key_of: dict[int, bytes] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.pins = [0] * num_slots

    def __len__(self) -> int:
        """Keyed slots (blocks the tier holds)."""
        return len(self._slot_of)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def slot(self, key: bytes) -> Optional[int]:
        return self._slot_of.get(key)

    def key(self, slot: int) -> Optional[bytes]:
        return self._key_of.get(slot)

    def touch(self, key: bytes) -> None:
        self._slot_of.move_to_end(key)

    def keys(self) -> Iterator[bytes]:
        return iter(self._slot_of)

    def take(self) -> tuple[Optional[int], Optional[bytes]]:
        """A slot to fill, pinned and unkeyed: a free one, else the least recently used unpinned one.
        Returns (slot, the key it gave up) or (None, None) when every slot is pinned."""
        if self._free:
            slot = self._free.pop()
            self.pins[slot] = 1
            return slot, None
        for key, slot in self._slot_of.items():
            if not self.pins[slot]:
                del self._slot_of[key]
                del self._key_of[slot]
                self.pins[slot] = 1
                return slot, key
        return None, None

    def bind(self, key: bytes, slot: int) -> None:
        """A taken (staged) slot now holds key's block, the most recently used."""
        assert key not in self._slot_of and slot not in self._key_of, "a key or slot bound twice"
        self._slot_of[key] = slot
        self._key_of[slot] = key

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        assert self.pins[slot] >= 0, f"host slot {slot} unpinned more often than pinned"
        if not self.pins[slot] and slot not in self._key_of:
            self._free.append(slot)

    def forget(self, key: bytes) -> None:
        """Drop key; its slot goes back to the free list once unpinned."""
        slot = self._slot_of.pop(key)
        del self._key_of[slot]
        if not self.pins[slot]:
            self._free.append(slot)

    def clear(self) -> None:
        """Drop every key whose slot no copy holds."""
        for key in [k for k, s in self._slot_of.items() if not self.pins[s]]:
            self.forget(key)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a host slot is free twice"
        assert len(self._slot_of) == len(self._key_of)
        for key, slot in self._slot_of.items():
            assert self._key_of.get(slot) == key, f"host slot {slot}: stale key"
            assert slot not in free, f"host slot {slot} is both keyed and free"
        for slot in range(self.num_slots):
            assert self.pins[slot] >= 0
            if slot in free:
                assert self.pins[slot] == 0, f"free host slot {slot} is pinned"
            elif slot not in self._key_of:
                assert self.pins[slot] > 0, f"host slot {slot} leaked: neither free, keyed nor pinned"


class DiskIndex:
    """The disk tier's keys (one file each), least recently used first, at most `capacity` of them.
    Keys being read are pinned: the LRU skips them, so a read never finds its file deleted by us."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self.reading: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> Iterator[bytes]:
        return iter(self._keys)

    def touch(self, key: bytes) -> None:
        self._keys.move_to_end(key)

    def add(self, key: bytes) -> list[bytes]:
        """Record a written file; returns the keys to delete to stay within capacity (LRU first)."""
        self._keys[key] = None
        self._keys.move_to_end(key)
        evicted = []
        for old in list(self._keys):
            if len(self._keys) <= self.capacity:
                break
            if old != key and not self.reading.get(old):
                del self._keys[old]
                evicted.append(old)
        return evicted

    def discard(self, key: bytes, unless_reading: bool = False) -> None:
        if not (unless_reading and self.reading.get(key)):  # (a read of it will say it is gone)
            self._keys.pop(key, None)

    def pin(self, key: bytes) -> None:
        self.reading[key] = self.reading.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        left = self.reading[key] - 1
        if left:
            self.reading[key] = left
        else:
            del self.reading[key]

    def check_integrity(self) -> None:
        assert len(self._keys) <= self.capacity + len(self.reading), "disk tier over its capacity"
        for key, n in self.reading.items():
            assert n > 0
