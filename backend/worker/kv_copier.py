"""The host pool and the copies between it and the device's KV cache (the model runner's).

A host slot holds one block of every layer: [layers, K|V, block_size, kv_heads, head_dim] in the
cache's dtype (a model of several KV-cache groups: one group's layers, the cache's `slots` pairs),
contiguous, so that a slot is one DMA and one file's payload (backend/kv/tiers/disk.py).

On the CPU the pool is a second buffer beside the KV cache and a plan's copies are 2 x layers
index copies each way, done when `execute` returns (its handle is None).

On a GPU the pool is pinned and the copies run on a stream of their own, so they overlap the
model's steps on the compute stream instead of waiting in line with them:
- the copy stream first waits for the compute stream's work so far (the steps that wrote the
  blocks it saves, and that last read the blocks it loads into);
- saves gather the blocks into a device staging buffer (an index_select per layer and K/V), then
  copy each block to its pinned slot; loads copy each slot to staging, then scatter it into the
  cache (index_copy_);
- an event marks the saves' end: the compute stream waits for it before the step that overwrites
  those blocks. Another marks the plan's end: it is the handle; the scheduler lets a loading
  request run only once it has completed (`done`), and the compute stream waits on the handles of
  loads whose request left mid-copy (`plan.waits`: their blocks may be handed out again).
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional

import numpy as np
import torch

from backend.kv.tiers.plan import TierPlan
from backend.worker.device import DeviceEnv, to_device

STAGING_BYTES = 64 << 20  # the device staging buffer's cap (GPU): plans larger than it go in chunks


class KVCopier:
    def __init__(self, env: DeviceEnv, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], host_bytes: int):
        # the runner's per-layer list names each pair once per KV-cache group (groups.py: layer k of every
        # group reads pair k); a block is one group's layers, so a slot holds each distinct pair once
        kv_caches = list({id(pair[0]): pair for pair in kv_caches}.values())
        k0 = kv_caches[0][0]
        shapes = sorted({(tuple(c.shape[1:]), c.dtype) for kv in kv_caches for c in kv}, key=str)
        if len(shapes) > 1:  # (a model with per-layer KV shapes: its blocks are not one slot's layout)
            raise ValueError(f"kv_host_cache_bytes: this model's layers keep KV blocks of different shapes "
                             f"{shapes}; the KV tiers move blocks of one shape")
        self.env = env
        self.kv_caches = kv_caches
        self.block_shape = (len(kv_caches), 2, *k0.shape[1:])
        self.dtype = k0.dtype
        self.block_bytes = math.prod(self.block_shape) * k0.element_size()
        self.num_slots = host_bytes // self.block_bytes
        if self.num_slots < 1:
            raise ValueError(f"kv_host_cache_bytes ({host_bytes}) is smaller than one KV block "
                             f"({self.block_bytes} bytes: {len(kv_caches)} layers x K and V x {tuple(k0.shape[1:])})")
        try:
            self.host = env.host_buffer(self.num_slots * self.block_bytes)
        except RuntimeError as exc:  # pinning fails where the host cannot lock that much memory
            raise ValueError(f"kv_host_cache_bytes ({host_bytes}): cannot allocate the host tier "
                             f"({'pinned ' if env.is_cuda else ''}memory): {exc}") from None
        self.slots = self.host.view(self.dtype).view(self.num_slots, *self.block_shape)
        self.stream = self.staging = None
        if env.is_cuda:
            self.stream = env.new_stream()
            chunk = max(1, min(64, STAGING_BYTES // self.block_bytes))
            self.staging = torch.empty((chunk, *self.block_shape), dtype=self.dtype, device=env.tensor_device)

    def host_bytes_of(self, slot: int) -> np.ndarray:
        """A slot's bytes as a uint8 numpy view (what the disk tier reads into and writes from)."""
        return self.host[slot * self.block_bytes:(slot + 1) * self.block_bytes].numpy()

    def execute(self, plan) -> Optional[Any]:
        """Make a TierPlan's copies; returns their handle (None: done already)."""
        if not self.env.is_cuda:
            self._copy_sync(plan.saves, to_host=True)
            self._copy_sync(plan.loads, to_host=False)
            return None
        return self._execute_on_stream(plan)

    def time_loads(self, num_blocks: int, repeats: int = 3) -> tuple[float, float]:
        """What a plan of host -> device loads costs here: (seconds whatever its size, seconds per
        block), from the best of `repeats` plans of one block and of `num_blocks` (fewer when the
        pool or the cache is smaller). Timed at start, before any request: blocks 0..n-1 are saved to
        slots 0..n-1 and loaded back, which leaves the cache as it was."""
        n = max(1, min(num_blocks, self.num_slots, self.kv_caches[0][0].shape[0]))

        def best(k: int) -> float:
            pairs = [(i, i) for i in range(k)]
            self.wait(self.execute(TierPlan(saves=pairs)))
            seconds = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                self.wait(self.execute(TierPlan(loads=pairs)))
                seconds = min(seconds, time.perf_counter() - started)
            return seconds

        one = best(1)
        per_block = max(0.0, (best(n) - one) / (n - 1)) if n > 1 else one
        return max(0.0, one - per_block), per_block

    def done(self, handle: Any) -> bool:
        return handle is None or handle.query()

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.synchronize()

    # -- CPU ------------------------------------------------------------------------------------
    def _copy_sync(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Saves [(block, slot)] into the pool (to_host) or loads [(slot, block)] back into the
        cache: 2 x layers index copies, each moving every block of the plan."""
        if not pairs:
            return
        src, dst = (torch.tensor(x, dtype=torch.int64) for x in zip(*pairs))
        for layer, kv in enumerate(self.kv_caches):
            for j, cache in enumerate(kv):
                host = self.slots[:, layer, j]
                if to_host:
                    host.index_copy_(0, dst, cache.index_select(0, src))
                else:
                    cache.index_copy_(0, dst, host.index_select(0, src))

    # -- GPU ------------------------------------------------------------------------------------
    def _execute_on_stream(self, plan) -> Any:
        env, stream, compute = self.env, self.stream, self.env.current_stream()
        saved = None
        with env.on_stream(stream):
            stream.wait_stream(compute)
            for chunk in self._chunks(plan.saves):
                self._gather(chunk)
            if plan.saves:
                saved = env.new_event()
                saved.record(stream)
            for chunk in self._chunks(plan.loads):
                self._scatter(chunk)
            end = env.new_event()
            end.record(stream)
        if saved is not None:
            compute.wait_event(saved)  # this step's model run overwrites the saved blocks
        for handle in plan.waits:
            compute.wait_event(handle)
        return end

    def _chunks(self, pairs: list[tuple[int, int]]):
        n = self.staging.shape[0]
        for i in range(0, len(pairs), n):
            yield pairs[i:i + n]

    def _index(self, values) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.int64), self.env.tensor_device)

    def _gather(self, saves: list[tuple[int, int]]) -> None:
        """Device blocks -> staging -> their pinned slots (one DMA per block)."""
        n = len(saves)
        blocks = self._index([b for b, _ in saves])
        for layer, kv in enumerate(self.kv_caches):
            for j, cache in enumerate(kv):
                self.staging[:n, layer, j].copy_(cache.index_select(0, blocks))
        for i, (_, slot) in enumerate(saves):
            self.slots[slot].copy_(self.staging[i], non_blocking=True)

    def _scatter(self, loads: list[tuple[int, int]]) -> None:
        """Pinned slots -> staging (one DMA per block) -> the device blocks."""
        n = len(loads)
        for i, (slot, _) in enumerate(loads):
            self.staging[i].copy_(self.slots[slot], non_blocking=True)
        blocks = self._index([b for _, b in loads])
        for layer, kv in enumerate(self.kv_caches):
            for j, cache in enumerate(kv):
                cache.index_copy_(0, blocks, self.staging[:n, layer, j])
