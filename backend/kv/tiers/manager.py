"""`KVTiers`: the host and disk tiers' bookkeeping, on the engine thread (docs/design.md, "KV-cache
tiers"). No torch here: it decides which blocks move, the model runner moves the bytes.

- saves: cached blocks the block manager hands out again (`blocks_removed`, its listener hook; their
  KV is intact until the step's model run) go to host slots, and with a disk tier on to files;
- loads: admission `probe`s, `claim`s and `start_load`s the blocks after a request's device prefix;
- each step `poll` takes in what landed; `take_plan` gives the step's copies to its plan (the worker
  makes them before the step's model run, backend/worker/kv_copier.py) and `issued` takes their handle.
"""
from __future__ import annotations

from itertools import takewhile
from typing import Any, Optional, Sequence

from backend.kv.block_manager import BlockListener
from backend.kv.tiers.index import DiskIndex, HostIndex
from backend.kv.tiers.plan import CopyPrices, KVLoad, TierClaim, TierCounts, TierPlan


class KVTiers(BlockListener):
    def __init__(self, copier, block_size: int, disk=None, disk_capacity: int = 0):
        # the runner's KVCopier (copier.py): moves the bytes (execute), tells a copy done (done), lends
        self.copier = copier  # a slot's bytes to the disk's reads and writes (host_bytes_of)
        self.block_size = block_size
        self.block_bytes = copier.block_bytes
        self.host = HostIndex(copier.num_slots)
        self._host_bytes_of = copier.host_bytes_of
        self.disk = disk
        self.disk_index: Optional[DiskIndex] = None
        if disk is not None:
            self.disk_index = DiskIndex(disk_capacity)
            for key in disk.scan():
                for gone in self.disk_index.add(key):
                    disk.delete(gone)
        self.counts = TierCounts(disk is not None, getattr(disk, "unreadable", 0))  # (entries the scan skipped)
        self.device: dict[int, bytes] = {}  # the device's prefix cache, block -> key, oldest first (for shutdown)
        self._saves: list[tuple[int, int, bytes]] = []  # (block, slot, key) for the next plan
        self._issuing: Optional[tuple[list, list]] = None  # the plan taken, until `issued`
        self._inflight: list[tuple[Any, list[tuple[int, bytes]], list[KVLoad]]] = []
        self._loads: list[KVLoad] = []  # not done yet
        self._writing: dict[bytes, int] = {}  # key -> host slot, queued for the disk
        self._salted: set[bytes] = set()  # keys under a LoRA adapter: never written to disk
        # Copies are done when issued (the CPU): a prefix all in host memory comes back before the
        # step's model run, so its request runs in the step it starts (admission.py).
        self.loads_at_once = False
        self.prices = CopyPrices()  # measured at the engine's start (engine/kv_tiers.py); free until then

    # -- the block manager's hook (inside its calls: appends only) --------------------------------
    def blocks_stored(self, blocks, keys, parent, root, token_ids) -> None:
        self.device.update(zip(blocks, keys))
        if root:  # a LoRA adapter's salt is per load, so a file of it could meet another adapter after a restart
            self._salted.update(keys)

    def blocks_removed(self, blocks: list[int], keys: list[bytes]) -> None:
        for block, key in zip(blocks, keys):
            self.device.pop(block, None)
            if self.host.slot(key) is not None:
                self.host.touch(key)  # the same key is the same bytes: nothing to copy
                continue
            slot, gone = self.host.take()
            if slot is None:  # every slot is in use by a copy: the block is not kept
                self.counts.host["dropped"] += 1
                self._left_host(key)
                continue
            if gone is not None:
                self._left_host(gone)
            self.host.bind(key, slot)
            self._saves.append((block, slot, key))

    def cache_cleared(self) -> None:
        self.device.clear()
        self.host.clear()

    def _left_host(self, key: bytes) -> None:
        if self.disk_index is None or key not in self.disk_index:
            self._salted.discard(key)

    # -- admission ----------------------------------------------------------------------------
    def where(self, key: bytes) -> Optional[bool]:
        """Where the lower tiers hold key: False in host memory, True on disk only, None nowhere."""
        on_disk = self.disk_index is not None and key in self.disk_index
        return False if self.host.slot(key) is not None else True if on_disk else None

    def locate(self, hashes: Sequence[bytes]) -> list[bool]:
        """`where` of these keys, from the first until one the tiers do not hold (nothing changes)."""
        return list(takewhile(lambda disk: disk is not None, map(self.where, hashes)))

    def claim(self, hashes: Sequence[bytes]) -> Optional[TierClaim]:
        """Pin the blocks of these keys, from the first, that a lower tier holds: host slots as they
        are, disk blocks into host slots taken for them. Stops where a key is in neither tier or no
        slot is left to stage a disk block in. None when nothing is claimed."""
        claim = TierClaim([], [], [])
        for key in hashes:
            from_disk = (slot := self.host.slot(key)) is None
            if not from_disk:
                self.host.pin(slot)
                self.host.touch(key)
            elif self.disk_index is not None and key in self.disk_index:
                slot, gone = self.host.take()
                if slot is None:
                    break
                if gone is not None:
                    self._left_host(gone)
                self.disk_index.pin(key)
            else:
                break
            claim.keys.append(key)
            claim.slots.append(slot)
            claim.from_disk.append(from_disk)
        return claim if claim.keys else None

    def drop_claim(self, claim: TierClaim) -> None:
        for key, slot, from_disk in zip(claim.keys, claim.slots, claim.from_disk):
            self.host.unpin(slot)
            if from_disk:
                self.disk_index.unpin(key)

    def start_load(self, seq_id: str, claim: TierClaim, blocks: Sequence[int]) -> KVLoad:
        """The claimed blocks go to `blocks` (the request's, reserved): disk reads start now, the
        device copy goes into the first plan after they all landed."""
        load = KVLoad(seq_id, claim, blocks)
        for i, (key, slot, from_disk) in enumerate(zip(claim.keys, claim.slots, claim.from_disk)):
            if from_disk:
                self.disk.read(("read", load, i), key, self._host_bytes_of(slot))
        self._loads.append(load)
        return load

    # -- one step -------------------------------------------------------------------------------
    def poll(self) -> None:
        """Take in what finished (the runner's copies, the disk's jobs): called as a step begins,
        so that a request whose prefix is back runs in it."""
        still = []
        for entry in self._inflight:
            if entry[0] is not None and not self.copier.done(entry[0]):
                still.append(entry)
            else:
                self._copies_landed(entry[1], entry[2])
        self._inflight = still
        if self.disk is not None:
            for token, ok, why in self.disk.completed():  # ("read" | "write" | "gone", ...)
                getattr(self, f"_{token[0]}_landed")(token, ok, why)
        for load in [x for x in self._loads if x.cancelled and not x.issued and not x.reads_pending]:
            self._retire(load)  # its request left while reading: no step may come to give its slots back

    def take_plan(self) -> TierPlan:
        """The copies to make before this step's model run; hand the runner's handle to `issued`."""
        plan = TierPlan(saves=[(b, s) for b, s, _ in self._saves])
        saved = [(s, k) for _, s, k in self._saves]
        self._saves = []
        loads = []
        for load in list(self._loads):
            if load.issued:
                if load.cancelled and not load.done:  # its blocks may be written by this step
                    plan.waits.append(load.handle)
                continue
            if load.reads_pending:
                continue
            n = self._retire(load)
            if n:
                plan.loads += zip(load.slots[:n], load.blocks[:n])
                loads.append(load)
                self._loads.append(load)
        self._issuing = (saved, loads)
        return plan

    def _retire(self, load: KVLoad) -> int:
        self._loads.remove(load)
        return load.retire(self.host)

    def abandon(self) -> None:
        """The plan taken was not carried out (its step failed): its saves are forgotten and its
        loads bring nothing."""
        if self._issuing is None:
            return
        saved, loads = self._issuing
        for slot, key in saved:
            self.host.forget(key)
        for load in loads:
            load.unpin_copied(self.host)
            load.num_loaded = 0
        self.issued(None)

    copies_in_flight = property(lambda self: bool(self._inflight))

    def issued(self, handle: Any, idle: bool = False) -> None:
        """The worker started the plan's copies; `handle` is None when they are done already.
        `idle`: the step ran nothing, so wait a little for a disk read."""
        if self._issuing is None:  # abandoned
            return
        (saved, loads), self._issuing = self._issuing, None
        self.counts.host["bytes_stored"] += len(saved) * self.block_bytes
        self.counts.host["bytes_loaded"] += sum(load.num_loaded for load in loads) * self.block_bytes
        for load in loads:
            load.handle = handle
        if handle is None:
            self._copies_landed(saved, loads)
        else:
            self._inflight.append((handle, saved, loads))
        if idle and self.disk is not None and any(load.reads_pending for load in self._loads):
            self.disk.wait(0.005)

    def _copies_landed(self, saved: list[tuple[int, bytes]], loads: list[KVLoad]) -> None:
        for slot, key in saved:
            if self.writable(key) and self.host.key(slot) == key:
                self._writing[key] = slot  # the slot stays pinned until the file is written
                self.disk.write(("write", key, slot), key, self._host_bytes_of(slot))
            else:
                self.host.unpin(slot)
        for load in loads:
            load.unpin_copied(self.host)
            load.done = True
            self._loads.remove(load)

    def writable(self, key: bytes) -> bool:
        return (self.disk is not None and key not in self.disk_index and key not in self._writing
                and key not in self._salted)

    def _read_landed(self, token: tuple, ok: bool, why: str) -> None:
        _, load, i = token
        key, slot = load.keys[i], load.slots[i]
        self.disk_index.unpin(key)
        load.ok[i] = ok
        load.reads_pending -= 1
        if ok:
            self.counts.disk["bytes_loaded"] += self.block_bytes
            self.disk_index.touch(key)
            if self.host.slot(key) is None:
                self.host.bind(key, slot)  # the host tier holds it from now on
        else:
            self.counts.refused(why)
            self.disk_index.discard(key)

    def _gone_landed(self, token: tuple, ok: bool, why: str) -> None:  # a write made room in the folder (disk.py)
        self.disk_index.discard(token[1], unless_reading=True)

    def _write_landed(self, token: tuple, ok: bool, why: str) -> None:
        _, key, slot = token
        del self._writing[key]
        self.host.unpin(slot)
        if not ok:
            self.counts.disk["write_failures"] += 1
            return
        self.counts.disk["bytes_stored"] += self.block_bytes
        for gone in self.disk_index.add(key):
            self.disk.delete(gone)
            if self.host.slot(gone) is None:
                self._salted.discard(gone)

    def write_host_block(self, key: bytes) -> bool:
        """Queue the host tier's block of key for the disk (shutdown); False when it need not or cannot."""
        slot = self.host.slot(key)
        if slot is None or not self.writable(key) or self.host.pins[slot]:
            return False
        self.host.pin(slot)
        self._copies_landed([(slot, key)], [])
        return True

    @property
    def disk_room(self) -> int:
        """Files the disk tier may still take without giving any away."""
        index = self.disk_index
        return 0 if index is None else index.capacity - len(index) - len(self._writing)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # -- figures and checks -----------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits, misses, bytes in and out, fill (blocks_used of blocks_total) and troubles."""
        fill = {"host": (len(self.host), self.host.num_slots)}
        if self.disk_index is not None:
            fill["disk"] = (len(self.disk_index), self.disk_index.capacity)
        return self.counts.figures(fill)

    @property
    def busy(self) -> bool:
        """Copies, loads or disk jobs still in flight."""
        return bool(self._saves or self._inflight or self._loads or self._writing
                    or (self.disk is not None and self.disk.pending))

    def check_integrity(self) -> None:
        """Every host pin belongs to a copy, a load or a write in flight (so none leaks), and the
        indexes are consistent."""
        self.host.check_integrity()
        want = [0] * self.host.num_slots
        saves = [s for _, s, _ in self._saves] + [s for _, saved, _ in self._inflight for s, _ in saved]
        for slot in saves + list(self._writing.values()):
            want[slot] += 1
        reading: dict[bytes, int] = {}
        for load in self._loads:
            for i, slot in enumerate(load.slots):
                if not load.issued or i < load.num_loaded:
                    want[slot] += 1
                if load.ok[i] is None:
                    reading[load.keys[i]] = reading.get(load.keys[i], 0) + 1
        assert want == self.host.pins, f"host pins {self.host.pins} but copies in flight account for {want}"
        if self.disk_index is not None:
            self.disk_index.check_integrity()
            assert reading == self.disk_index.reading, "disk reads in flight and their pins disagree"
