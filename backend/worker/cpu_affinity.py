"""Pin the calling thread's OpenMP team to one core per thread (vLLM's VLLM_CPU_OMP_THREADS_BIND).

Unpinned, the kernel moves torch's OpenMP threads between cores; two threads may share one core
for a while and every op of the step waits for the slower one. Pinned, thread i of the team stays
on core i. The team belongs to the thread that calls torch (libgomp keeps one pool per calling
thread), so `pin_omp_threads` must run on the thread that steps the engine.

How: libgomp's own entry point for `#pragma omp parallel` (GOMP_parallel) is called through ctypes
with a Python callback; each team member runs it once and sets its own affinity. The libgomp is
the one torch loaded (torch/lib/libgomp.so.1), so the pinned threads are the ones torch's ops use.

The cores, as they were before any thread was pinned, are kernels/cpuinfo.py's `allowed_cores`
(importable from here too). `team_placement` reads the calling thread's team back as it runs now
(each member's cores), so a served engine's placement can be held to the in-process one's
(AsyncEngine.cpu_placement, logged by the Triton model at start; issue 47).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Optional, Sequence

from kernels.cpuinfo import allowed_cores  # the cores as before any pinning (also runner.py's name)

__all__ = ["allowed_cores", "cpu_threads", "pin_omp_threads", "set_cpu_threads", "team_placement"]
log = logging.getLogger(__name__)
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _libgomp() -> Optional[ctypes.CDLL]:
    import torch
    path = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    name = str(path) if path.exists() else "libgomp.so.1"
    try:  # RTLD_NOLOAD-like: the library torch already loaded is returned, not a second copy
        return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def _team(num_threads: int, visit) -> bool:
    """Run visit(thread number) once in every member of a team of num_threads (the caller is
    thread 0); False when the OpenMP runtime is not torch's libgomp (nothing ran)."""
    gomp = _libgomp()
    if gomp is None or not hasattr(gomp, "GOMP_parallel"):
        return False
    gomp.omp_get_thread_num.restype = ctypes.c_int
    callback = _CALLBACK(lambda _data: visit(gomp.omp_get_thread_num()))  # under the GIL ctypes takes
    gomp.GOMP_parallel.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.GOMP_parallel(callback, None, num_threads, 0)
    return True


def team_placement() -> list[list[int]]:
    """The calling thread's torch team as it is now: for thread 0 .. torch.get_num_threads() - 1,
    the cores it may run on (sorted). [[0], [1]]: two threads pinned one per core; [[0, 1]]: one
    thread, free on both. Empty when the runtime is not torch's libgomp."""
    import torch
    n = torch.get_num_threads()
    found: dict[int, list[int]] = {}
    lock = threading.Lock()

    def visit(i: int) -> None:
        with lock:
            found[i] = sorted(os.sched_getaffinity(0))
    if not _team(n, visit):
        return []
    return [found[i] for i in sorted(found)]


def pin_omp_threads(num_threads: int, cores: Optional[Sequence[int]] = None) -> dict[int, int]:
    """Pin a team of num_threads threads (the caller is thread 0) to `cores` (default: the cores
    this process may run on, in order). Returns {OpenMP thread number: core}; empty when the
    OpenMP runtime is not torch's libgomp (then nothing is pinned)."""
    cores = allowed_cores() if cores is None else list(cores)
    if num_threads < 1 or num_threads > len(cores):
        raise ValueError(f"cannot pin {num_threads} threads to {len(cores)} cores {cores}")
    placed: dict[int, int] = {}
    lock = threading.Lock()

    def pin(n: int) -> None:
        os.sched_setaffinity(0, {cores[n]})
        with lock:
            placed[n] = cores[n]
    return placed if _team(num_threads, pin) else {}


def cpu_threads(ranks: int = 1) -> int:
    """The engine's torch threads on CPU: OMP_NUM_THREADS when set, else every core this process
    may run on but one. OpenMP threads wait for each other at every op; when a core is also busy
    with something else (tritonserver, the client, another process) the op stalls until the
    descheduled thread returns. Measured on a loaded 2-core machine (docs/performance.md): 2
    threads ran the tiny model at 132 tok/s, 1 thread at 933 (SmolLM2 batch 16: 74 vs 109). More
    than one thread are pinned one per core (`set_cpu_threads`), as vLLM-CPU binds its own
    (INFLIGHT_CPU_PIN=0: left to the kernel), counted as before any pinning (a second engine gets the same).
    `ranks`: tensor-parallel ranks on this machine, which share the cores."""
    import torch
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, (len(allowed_cores()) - 1) // ranks)


def set_cpu_threads(rank: int = 0, ranks: int = 1) -> int:
    """Give the calling thread (the one that steps the engine) its torch threads, `cpu_threads`,
    pinned one per core to this rank's own cores when there are enough (INFLIGHT_CPU_PIN=0: left to
    the kernel). Returns the thread count."""
    import torch
    threads = cpu_threads(ranks)
    torch.set_num_threads(threads)
    cores = allowed_cores()[rank * threads:][:threads]  # each rank its own
    if 1 < threads == len(cores) and os.environ.get("INFLIGHT_CPU_PIN", "1") != "0":
        log.info("OpenMP threads pinned to cores %s", pin_omp_threads(threads, cores))
    return threads
