"""The launchers' child processes as process groups: a child that dies with its parent, and a
group signalled and waited for until none of it is left (tritonserver and every stub it forked)."""
from __future__ import annotations

import os
import signal
import time


def die_with_parent() -> None:
    """In the child, before exec (Popen's preexec_fn): SIGTERM when our process dies, however it
    dies (Linux)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def killpg(pgid: int, sig: int) -> None:
    """`sig` to every process of the group, if any is left."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_group_gone(pgid: int, seconds: float) -> None:
    """Until no process of the group is left, or `seconds` passed."""
    deadline = time.monotonic() + seconds
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
