"""Host memory in 2 MB pages for what the CPU kernels stream every step: the weights and the KV cache.

Why: a batch-1 decode step reads every weight once, from memory, in order, and each 2-core VM
here reads at most ~13 GB/s a core: that rate is set by how many misses a core keeps in flight,
and with 4 KB pages the hardware prefetcher stops at every page boundary and every page costs a
TLB walk. In 2 MB pages the same GEMVs ran 1.1-1.2x faster, and a plain sum of the buffer read 38
GB/s instead of 27 (docs/performance.md, "Huge pages"). Linux gives 2 MB pages to anonymous memory
that asks for them (transparent huge pages in `madvise` mode, the default of this machine and of
many distributions; in `always` mode it needs no asking, in `never` mode nothing does). torch's
allocator asks only under THP_MEM_ALLOC_ENABLE, which must be set before its first allocation; so
the arrays the kernels stream are placed here instead, once, at load:

- `place(t)`: a copy of `t` in an anonymous mapping advised MADV_HUGEPAGE, 64-byte aligned; small
  arrays share 64 MB mappings (an arena), arrays over 16 MB have their own. The memory lives as
  long as any tensor that views it (torch.frombuffer keeps the mapping).
- `empty(shape, dtype)`: the same placement, for a caller that fills it (a mixture of experts' packed panels).
- `zeros(shape, dtype)`: a zeroed tensor of its own mapping (a layer's K or V cache), touched at
  once as torch.zeros would (no page faults while serving).

INFLIGHT_HUGE_PAGES=0 turns it off (plain torch tensors, as before), for measuring; so does a
kernel whose transparent huge pages are `never`, or one without them."""
from __future__ import annotations

import functools
import mmap
import os
import threading
from pathlib import Path

import torch

PAGE = 2 << 20   # x86-64's transparent huge page
ARENA = 64 << 20  # the mapping small arrays share
ALIGN = 64        # a cache line: every placed array starts on one
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)  # asked for every array placed at load: the file read once
def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), or "" without one."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def enabled() -> bool:
    """Whether arrays are placed in huge pages: asked for (INFLIGHT_HUGE_PAGES, default on), and
    a kernel that grants them (not `never`) and a Python that can ask (mmap.MADV_HUGEPAGE)."""
    return (os.environ.get("INFLIGHT_HUGE_PAGES", "1") != "0" and thp_mode() in ("always", "madvise")
            and hasattr(mmap, "MADV_HUGEPAGE"))


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` bytes (uint8) of a fresh anonymous mapping (zeros), starting on a 2 MB boundary and
    advised MADV_HUGEPAGE before any page of it is touched."""
    span = _round_up(max(nbytes, 1), PAGE)
    mm = mmap.mmap(-1, span + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # room to align
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive while a view of it lives
    start = (-whole.data_ptr()) % PAGE
    mm.madvise(mmap.MADV_HUGEPAGE, start, span)
    return whole[start:start + nbytes]


class _Arena:
    """Bump allocation over ARENA-byte mappings, for arrays smaller than a quarter of one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._block: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > ARENA // 4:
            return mapping(nbytes)
        with self._lock:
            if self._block is None or self._used + nbytes > ARENA:
                self._block, self._used = mapping(ARENA), 0
            out = self._block[self._used:self._used + nbytes]
            self._used = _round_up(self._used + nbytes, ALIGN)
            return out


_arena = _Arena()


def _typed(raw: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return raw.view(dtype).view(shape)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, in huge pages where `enabled()` (its contents zeros or
    whatever it is given: the mappings are never reused)."""
    size = torch.Size(shape)
    if size.numel() == 0 or not enabled():
        return torch.empty(size, dtype=dtype)
    return _typed(_arena.take(size.numel() * dtype.itemsize), size, dtype)


def place(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor `t` in huge pages (contiguous); `t` itself where `enabled()` is false,
    or it is empty or not on the CPU."""
    if t.device.type != "cpu" or t.numel() == 0 or not enabled():
        return t
    return empty(tuple(t.shape), t.dtype).copy_(t)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, in huge pages of its own mapping where `enabled()`."""
    if not enabled():
        return torch.zeros(shape, dtype=dtype)
    size = torch.Size(shape)
    # every page faulted now, as torch.zeros does, not in a step
    return _typed(mapping(size.numel() * dtype.itemsize), size, dtype).zero_()
