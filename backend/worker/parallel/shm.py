"""The CPU's tensor-parallel collectives between ranks of one machine, through shared memory.

gloo over loopback TCP costs ~1.3 ms per all-reduce on these 2-core machines whatever the size (a
[1, 576] tensor as long as a [16, 576] one: it is wake-ups and system calls), and a decode step of a
30-layer model makes 61 of them: ~60% of a TP=2 step on SmolLM2's shape. Here every rank maps one
segment: per rank two data slots (double-buffered) and a sequence counter on a cache line of its
own. An all-reduce writes the rank's tensor into its slot, publishes the operation's number in its
counter, waits until every rank's counter has reached it, and sums every slot in rank order, so
every rank computes the same bits (for two ranks, exactly gloo's a + b). A rank reuses a slot two
operations later: by then every rank has published the operation in between, which it does only
after reading the slot. x86's store order (data before counter) is what makes a published counter
mean its data is there; other machines keep gloo.

Waiting spins briefly, then yields the core, then sleeps in short steps, checking that the group
has not failed (a lost rank is seen by rank 0's watch, backend/worker/parallel/group.py) and has
not been closed. Tensors larger than a slot (long prefills) go through gloo, where latency is
amortized. The segment is a file in /dev/shm, unlinked as soon as every rank has mapped it.

The C layer stack (issue 47) all-reduces on the same segment in C (kernels/cpu/shm_reduce.py,
`native()`): the same protocol and sum order, counted from the same counters (a rank's own counter
is its last operation's number), so C and Python operations interleave on one segment.
"""
from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from backend.core.errors import RankLostError

SLOT_BYTES = 4 << 20  # a decode step's tensors and a batch's logits shard fit; prefills go through gloo
LINE = 64  # a counter per cache line
SHM_DIR = Path("/dev/shm")
SPIN_S, YIELD_S = 20e-6, 1e-3


def usable() -> bool:
    """Shared-memory collectives need x86's store order and a /dev/shm."""
    return platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def new_segment_name() -> str:
    return f"inflight-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class ShmCollectives:
    def __init__(self, name: str, rank: int, size: int, failed: Callable[[], Optional[str]],
                 create: bool = False, slot_bytes: int = SLOT_BYTES):
        self.rank, self.size, self.slot_bytes, self.failed = rank, size, slot_bytes, failed
        self.path = SHM_DIR / name
        header = (size + 1) * LINE  # the counters, then the closed flag
        total = header + 2 * size * slot_bytes
        if create:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, total)
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._ctrl = np.ndarray((size + 1, LINE // 8), dtype=np.int64, buffer=self._map)
        self._data = np.ndarray((2, size, slot_bytes), dtype=np.uint8, buffer=self._map, offset=header)
        self._failed = np.zeros(1, dtype=np.int64)  # set by fail(): what the C side's wait reads
        self._native = None

    def unlink(self) -> None:
        """Every rank has mapped the segment: its file can go (the mappings stay)."""
        self.path.unlink(missing_ok=True)

    def native(self):
        """The C all-reduce on this segment (kernels/cpu/shm_reduce.py's ShmReduce), made once; it
        raises CpuKernelUnavailable where no C compiler builds it."""
        if self._native is None:
            from kernels.cpu.shm_reduce import ShmReduce
            self._native = ShmReduce(self._ctrl.ctypes.data, self._data.ctypes.data, self.rank, self.size,
                                     self.slot_bytes, self._failed.ctypes.data)
        return self._native

    def fail(self) -> None:
        """The group lost a rank: a C wait stops too (the Python side asks `failed`)."""
        self._failed[0] = 1

    def fits(self, tensor: torch.Tensor) -> bool:
        return (tensor.device.type == "cpu" and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() <= self.slot_bytes)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (contiguous, on the CPU) over the ranks, in place, in rank order."""
        slots = self._exchange(tensor)
        flat = tensor.view(-1)
        if self.size > 1:
            torch.add(slots[0], slots[1], out=flat)
        for r in range(2, self.size):
            flat.add_(slots[r])
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place (every rank publishes; the others copy rank 0's)."""
        first = self._exchange(tensor)[0]
        if self.rank:
            tensor.view(-1).copy_(first)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` side by side along the last dimension."""
        return torch.cat([s.view(tensor.shape) for s in self._exchange(tensor)], dim=-1)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Publish this rank's tensor and wait for every rank's: their slots, as the tensor's dtype
        (views into the segment, valid until the operation after next)."""
        n = tensor.numel() * tensor.element_size()
        seq = int(self._ctrl[self.rank, 0]) + 1  # the rank's last operation, Python's or C's, + 1
        buf = seq % 2
        slots = [torch.from_numpy(self._data[buf, r, :n]) for r in range(self.size)]
        slots[self.rank].copy_(tensor.reshape(-1).view(torch.uint8))
        self._ctrl[self.rank, 0] = seq  # after the data: x86 keeps stores in order
        self._wait(seq)
        return [s.view(tensor.dtype) for s in slots]

    def _wait(self, seq: int) -> None:
        counters = self._ctrl[:self.size, 0]
        if (counters >= seq).all():
            return
        start = time.perf_counter()
        while not (counters >= seq).all():
            waited = time.perf_counter() - start
            if waited > SPIN_S:
                if self._ctrl[self.size, 0]:
                    raise RankLostError("the tensor-parallel group was closed")
                reason = self.failed()
                if reason is not None:
                    raise RankLostError(reason)
                if waited < YIELD_S:
                    os.sched_yield()
                else:
                    time.sleep(50e-6)

    def close(self) -> None:
        """Rank 0: release every rank waiting on this segment (they raise); every rank: unmap it.
        (A rank other than 0 that fails says why in the store, and rank 0's watch sees it exit.)"""
        if not hasattr(self, "_ctrl"):
            return
        if self.rank == 0:
            self._ctrl[self.size, 0] = 1
        if self._native is not None:
            self._native.detach()
        self.unlink()
        del self._ctrl, self._data
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with the process
            pass
