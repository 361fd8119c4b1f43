"""Keep the memory of freed activations in the process (glibc malloc), for the CPU engine.

glibc hands an allocation of 32 MB or more (a prefill chunk's activations: 4,096 rows x 3,072
floats is 50 MB) straight to mmap, and gives it back with munmap when torch frees it; smaller
ones it returns to the kernel whenever the free top of the heap grows past the trim threshold.
Either way the next step's tensors land on fresh pages, and every 4 KB page costs a fault and a
zeroing. Measured on SmolLM2 (docs/performance.md): 1.5 million faults and 3 s of system time in
a 60 s run of 128 requests; with the thresholds raised, 25 thousand and 0.4 s, and the run 7%
shorter. The GPU has its caching allocator for this; on the CPU, raising the thresholds is ours.

The cost: the process keeps its peak activation memory (a few hundred MB at a 4,096-token
budget) instead of handing it back between steps. INFLIGHT_CPU_MALLOPT=0 leaves glibc's defaults.
Other C libraries (musl) have no mallopt; there this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 30  # only allocations over 1 GB still go to mmap
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: never trim below 2 GB of free top


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True when both were taken."""
    if os.environ.get("INFLIGHT_CPU_MALLOPT", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not taken:
        log.warning("glibc refused the malloc thresholds; freed activations go back to the kernel")
    return taken
