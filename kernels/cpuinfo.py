"""What this machine's CPU is: the one reader of /proc/cpuinfo in the repository, and the cores this
process may run on.

`parse(text)` reads the first processor's "model name" and "flags" lines of a cpuinfo text (every
core of a machine lists the same); `read(path)` parses a file (None where it cannot be read) and
`this_cpu()` is /proc/cpuinfo's, read once per process. `cpu_model()` and `cpu_flags()` are its
two fields, with fallbacks where the file does not say (platform.processor(); no flags).

`allowed_cores()` is the cores this process could use when this module was imported, that is before
the engine pinned its OpenMP threads one per core (backend/worker/cpu_affinity.py): a pinned thread's
own os.sched_getaffinity(0) then lists one core, so anything that sizes a pool of threads from it
(a second engine built on that thread, xgrammar's pool) would get one thread.

No torch and nothing of backend here: kernels/ is the lowest layer.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PATH = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuInfo:
    model: str  # the "model name" line; "" where it is not listed (ARM lists none)
    flags: frozenset[str]  # the "flags" line's instruction sets (avx2, avx512f, amx_bf16, ...)


def parse(text: str) -> CpuInfo:
    """The first "model name" and "flags" lines of a cpuinfo text."""
    model, flags = None, None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = frozenset(value.split())
        if model is not None and flags is not None:
            break
    return CpuInfo(model or "", flags or frozenset())


def read(path: Path = PATH) -> Optional[CpuInfo]:
    """`parse` of a cpuinfo file; None where it cannot be read (no /proc: macOS, Windows)."""
    try:
        return parse(Path(path).read_text())
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def this_cpu() -> Optional[CpuInfo]:
    """This machine's /proc/cpuinfo, read once per process; None where there is none."""
    return read(PATH)


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 7763 64-Core Processor"); where /proc/cpuinfo does not list
    one, platform.processor(), else the machine's architecture."""
    info = this_cpu()
    return (info.model if info else "") or platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> frozenset[str]:
    """The instruction sets /proc/cpuinfo lists; empty where it lists none."""
    info = this_cpu()
    return info.flags if info else frozenset()


def _affinity() -> tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


_ALLOWED: tuple[int, ...] = _affinity()  # as at import, before any thread was pinned


def allowed_cores() -> list[int]:
    """The cores this process may run on, as they were before any thread was pinned (pinning narrows
    the calling thread's own affinity to one core, which os.sched_getaffinity(0) would then report)."""
    return list(_ALLOWED)
