"""The KV tiers of one engine: built from its config over the worker's copier, and written down to
disk when it closes.

`make_kv_tiers` returns the tiers, or `NoKVTiers` when kv_host_cache_bytes is 0. The engine gives
their `listener` (the tiers themselves, or None) to the KV-cache groups as a BlockListener and to the
scheduler, which polls them as each step is scheduled, claims prefixes for admission and puts each
step's copies in its plan; `figures` and `close` are the engine's.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Union

from backend.core.config import EngineConfig
from backend.kv.tiers.disk import DiskStore
from backend.kv.tiers.fingerprint import model_fingerprint
from backend.kv.tiers.grouped import GroupListener
from backend.kv.tiers.manager import KVTiers
from backend.kv.tiers.plan import CopyPrices
from backend.models.loader import weight_files

log = logging.getLogger(__name__)
# At shutdown, how long the device's cached blocks may take to reach the disk (AsyncEngine.shutdown waits 10 s)
PERSIST_SECONDS = 8.0
TIMED_BLOCKS = 8  # the larger plan of loads timed at start (measure_copy_prices)


class NoKVTiers:
    """The tiers when they are off: every call does nothing."""
    idle = True
    listener = None

    def figures(self) -> dict:
        return {}

    def follow(self, blocks) -> None:
        pass

    def close(self) -> None:
        pass


class EngineKVTiers(KVTiers):
    """The tiers as the engine holds them: their stats under one key, and a close that first writes
    the device's cached blocks down (`persist_kv_tiers`) so that a restarted engine finds them."""

    @property
    def listener(self) -> "EngineKVTiers":
        return self

    def figures(self) -> dict:
        return {"kv_tiers": self.stats()}

    def follow(self, blocks) -> None:
        """Hear every KV-cache group's prefix cache: the first group's through the listeners the
        groups were built with, the others' under their own keys (backend/kv/tiers/grouped.py)."""
        for g, manager in enumerate(getattr(blocks, "groups", ())[1:], 1):
            manager.listeners.append(GroupListener(self, g))

    @property
    def idle(self) -> bool:
        """Nothing in flight and no host slot pinned: what a workload leaves behind."""
        return not self.busy and not any(self.host.pins)

    def close(self) -> None:
        try:
            persist_kv_tiers(self)
        finally:
            super().close()


def make_kv_tiers(config: EngineConfig, runner) -> Union[EngineKVTiers, NoKVTiers]:
    """The host pool (the runner's copier), the disk store and the bookkeeping."""
    if not config.kv_host_cache_bytes:
        return NoKVTiers()
    copier = runner.attach_kv_copier(config.kv_host_cache_bytes)
    disk, capacity = None, 0
    if config.kv_disk_cache_dir:
        settings = {"dtype": str(runner.dtype), "kv_dtype": str(copier.dtype), "block_shape": copier.block_shape,
                    "quantization": runner.weights.quantization, "tp_rank": runner.tp.rank if runner.tp else 0,
                    "tp_size": runner.tp.size if runner.tp else 1}
        model_dir = Path(config.model_path)
        fingerprint = model_fingerprint(weight_files(model_dir), (model_dir / "config.json").read_bytes(), settings)
        disk = DiskStore(config.kv_disk_cache_dir, fingerprint, copier.block_bytes, config.kv_disk_cache_bytes)
        capacity = config.kv_disk_cache_bytes // disk.file_bytes
        if capacity < 1:
            disk.close()
            raise ValueError(f"kv_disk_cache_bytes ({config.kv_disk_cache_bytes}) is smaller than one block's "
                             f"file ({disk.file_bytes} bytes)")
    tiers = EngineKVTiers(copier, config.kv_block_size, disk, capacity)
    tiers.loads_at_once = not runner.env.is_cuda
    tiers.prices = measure_copy_prices(copier, disk)
    log.info("KV tiers: host %d blocks (%.1f MiB%s)%s", copier.num_slots, copier.num_slots * copier.block_bytes / 2**20,
             ", pinned" if runner.env.is_cuda else "",
             f"; disk {capacity} blocks in {disk.folder} ({len(tiers.disk_index)} there already)" if disk else "")
    return tiers


def measure_copy_prices(copier, disk) -> CopyPrices:
    """This machine's price of bringing blocks back (a few milliseconds at start): a plan of host ->
    device copies, per block, and a disk block's read and HMAC check (backend/sched/tier_choice.py
    weighs them against computing the blocks again)."""
    plan, block = copier.time_loads(TIMED_BLOCKS)
    prices = CopyPrices(plan, block, disk.time_read() if disk is not None else 0.0)
    log.info("KV tiers: a load costs %.3f ms + %.3f ms a block from host memory%s", plan * 1e3, block * 1e3,
             f" (+ {prices.disk_block_seconds * 1e3:.3f} ms a block from disk)" if disk is not None else "")
    return prices


def persist_kv_tiers(tiers: KVTiers, seconds: float = PERSIST_SECONDS) -> int:
    """At shutdown, with a disk tier: the host tier's blocks not on disk yet, then the device's
    cached blocks (most recently stored first) go to files, within the disk's room and `seconds`,
    so that the first turn after a restart finds them. Returns how many were queued."""
    if tiers.disk is None:
        return 0
    deadline = time.monotonic() + seconds
    queued = sum(tiers.write_host_block(key) for key in list(tiers.host.keys()))
    todo = [(b, k) for b, k in reversed(tiers.device.items()) if tiers.writable(k) and tiers.host.slot(k) is None]
    todo = todo[:max(0, tiers.disk_room)]
    step = max(1, tiers.host.num_slots // 2)
    for i in range(0, len(todo), step):
        if time.monotonic() >= deadline:
            break
        batch = todo[i:i + step]
        tiers.blocks_removed([b for b, _ in batch], [k for _, k in batch])  # staged through host slots
        _copy_now(tiers)
        while tiers.copies_in_flight and time.monotonic() < deadline:
            tiers.poll()
        queued += len(batch)
        tiers.disk.drain(max(0.0, deadline - time.monotonic()))  # frees the slots for the next batch
        tiers.poll()
    tiers.disk.drain(max(0.0, deadline - time.monotonic()))
    tiers.poll()
    log.info("KV tiers: %d blocks queued for %s at shutdown", queued, tiers.disk.folder)
    return queued


def _copy_now(tiers: KVTiers) -> None:
    """The tiers' next plan of copies, made at once by their copier (at close no step runs them)."""
    plan = tiers.take_plan()
    try:
        handle = tiers.copier.execute(plan) if plan else None
    except BaseException:
        tiers.abandon()
        raise
    tiers.issued(handle)
