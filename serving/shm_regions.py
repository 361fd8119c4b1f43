"""The Python backend's shared-memory regions of one tritonserver, named so that the launcher can
remove them once that server is gone.

Each model instance's stub talks to tritonserver through a region in /dev/shm (1 MB to start),
which tritonserver unlinks when it exits in order. Killed (SIGKILL, the OOM killer, a stop that
timed out) it unlinks nothing, and the regions stay in /dev/shm, memory of its tmpfs, until the
machine restarts: 65 had piled up on a test machine in a day of runs, and a container's /dev/shm
is 64 MB unless `--shm-size` says more. So each server the launcher starts gets a prefix of its own
(the Python backend's `shm-region-prefix-name`, a `--backend-config`), and after its process
group is gone the launcher removes that prefix's regions: its own, never another server's.
"""
from __future__ import annotations

import uuid
from pathlib import Path

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "triton_python_backend_shm_region_"  # the Python backend's own


def new_prefix() -> str:
    """A region prefix for one server: the backend's, recognizable, then a token of its own."""
    return f"{DEFAULT_PREFIX}inflight_{uuid.uuid4().hex[:12]}_"


def backend_config(prefix: str) -> str:
    return f"--backend-config=python,shm-region-prefix-name={prefix}"


def regions(prefix: str) -> list[Path]:
    return sorted(SHM_DIR.glob(prefix + "*"))


def remove(prefix: str) -> int:
    """Unlink the regions under `prefix` (a stub still mapping one keeps its memory until it
    unmaps); how many there were."""
    left = regions(prefix)
    for path in left:
        path.unlink(missing_ok=True)
    return len(left)
