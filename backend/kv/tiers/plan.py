"""The KV tiers' data: a step's plan of copies, a claim on lower-tier blocks, a load in flight. No torch here."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


@dataclass
class TierPlan:
    """One step's copies, for the runner: saves before loads (a load may land in a block a save
    copies out in the same step), both before the step's model run."""
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    waits: list[Any] = field(default_factory=list)  # copies in flight into blocks that were freed since

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.waits)


@dataclass
class TierClaim:
    """Blocks after a request's device prefix that a lower tier holds, their host slots pinned."""
    keys: list[bytes]
    slots: list[int]
    from_disk: list[bool]

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class CopyPrices:
    """What bringing prefix blocks back from the tiers costs on this machine, measured when the
    engine starts (backend/engine/kv_tiers.py): a plan of host -> device copies (`plan_seconds`,
    whatever its size) plus `host_block_seconds` per block; a disk block adds its file's read and
    HMAC check (`disk_block_seconds`) before that copy. What admission weighs against computing the
    blocks again (backend/sched/tier_choice.py)."""
    plan_seconds: float = 0.0
    host_block_seconds: float = 0.0
    disk_block_seconds: float = 0.0

    def load_seconds(self, num_host: int, num_disk: int) -> float:
        """Bringing back num_host blocks held in host memory and num_disk blocks held on disk."""
        if not num_host + num_disk:
            return 0.0
        return self.plan_seconds + (num_host + num_disk) * self.host_block_seconds + num_disk * self.disk_block_seconds


class KVLoad:
    """A request's prefix blocks on their way back into the device blocks it reserved."""

    def __init__(self, seq_id: str, claim: TierClaim, blocks: Sequence[int]):
        self.seq_id = seq_id
        self.keys, self.slots, self.blocks = claim.keys, claim.slots, list(blocks)
        self.ok: list[Optional[bool]] = [None if d else True for d in claim.from_disk]
        self.reads_pending = sum(claim.from_disk)
        self.issued = False
        self.handle: Any = None  # the runner's handle of the device copy (None: done when issued)
        self.done = False
        self.cancelled = False
        self.num_loaded = 0  # blocks from the first on that arrived (set when issued)
        self.counted = False  # its request counted them computed when it started (they came back at once)
        # a model of several KV-cache groups (grouped.py): whole or nothing, and the positions it brings
        self.positions: Optional[int] = None
        self.started = time.monotonic()

    def retire(self, host) -> int:
        """Its reads all ended and it leaves the waiting list: the leading blocks that arrived
        (none when its request left) are to be copied, the other host slots are unpinned."""
        n = 0 if self.cancelled else next((i for i, ok in enumerate(self.ok) if not ok), len(self.ok))
        if self.positions is not None and n < len(self.ok):
            n = 0  # a part of a grouped load would leave a local group without its window
        for slot in self.slots[n:]:
            host.unpin(slot)
        self.num_loaded, self.issued, self.done = n, True, not n
        return n

    def unpin_copied(self, host) -> None:
        """The host slots of the blocks it copied (or was to copy) are free to go."""
        for slot in self.slots[:self.num_loaded]:
            host.unpin(slot)

    def cancel(self) -> None:
        """Its request left (aborted, preempted, failed): nothing is copied any more, its slots
        are given back once the copies and reads in flight end."""
        self.cancelled = True


class TierCounts:
    """Per tier (device, host, disk): the prefix blocks that started requests asked it for and it
    held (`hits`) or not (`misses`); the bytes it took in and gave out; and its troubles."""

    def __init__(self, disk: bool, unreadable: int = 0):
        self.device = {"hits": 0, "misses": 0}
        # load_chosen / recompute_chosen: blocks found here that admission chose to copy back or to compute
        # again (kv_tier_load_policy; backend/sched/tier_choice.py)
        self.host = {"hits": 0, "misses": 0, "bytes_loaded": 0, "bytes_stored": 0, "dropped": 0,
                     "load_chosen": 0, "recompute_chosen": 0}
        self.disk = {"hits": 0, "misses": 0, "bytes_loaded": 0, "bytes_stored": 0, "rejected": 0, "write_failures": 0,
                     "tampered": 0, "unreadable": unreadable, "load_chosen": 0, "recompute_chosen": 0}
        self.tiers = ("device", "host", "disk") if disk else ("device", "host")

    def refused(self, why: str) -> None:
        """A disk file not loaded, by the reason disk.py gave: tampered (its HMAC), unreadable (a link,
        another user's), missing (another engine made room: a miss, no fault) or rejected (torn, foreign)."""
        kind = why.split(":")[0]
        if kind != "missing":
            self.disk[kind if kind in ("tampered", "unreadable") else "rejected"] += 1

    def lookup(self, num_hashes: int, device_blocks: int, claim: Optional[TierClaim],
               declined: Sequence[bool] = ()) -> None:
        """A request started: of its `num_hashes` prefix blocks, where each was found (or not).
        `declined`: the blocks after the claim that a tier held but are computed again (True: on disk)."""
        on_disk = (sum(claim.from_disk) if claim else 0) + sum(declined)
        in_host = (claim.num_blocks if claim else 0) + len(declined) - on_disk
        self.found(num_hashes, device_blocks, in_host, on_disk)

    def found(self, num_hashes: int, device_blocks: int, in_host: int, on_disk: int) -> None:
        """Of a request's `num_hashes` prefix blocks, how many each tier held."""
        left = num_hashes - device_blocks
        for tier, hits, asked in (("device", device_blocks, num_hashes), ("host", in_host, left),
                                  ("disk", on_disk, left - in_host)):
            getattr(self, tier)["hits"] += hits
            getattr(self, tier)["misses"] += asked - hits

    def chose(self, from_disk: Sequence[bool], num_loaded: int) -> None:
        """Admission chose to load the first num_loaded of these blocks and to compute the rest again."""
        for i, disk in enumerate(from_disk):
            (self.disk if disk else self.host)["load_chosen" if i < num_loaded else "recompute_chosen"] += 1

    def figures(self, fill: dict[str, tuple[int, int]]) -> dict[str, dict[str, int]]:
        out = {tier: dict(getattr(self, tier)) for tier in self.tiers}
        for tier, (used, total) in fill.items():
            out[tier].update(blocks_used=used, blocks_total=total)
        return out
