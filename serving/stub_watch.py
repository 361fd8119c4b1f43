"""A Python-backend stub that tritonserver gave up on while it initialized, and then waits for
forever: found from outside and ended, so that the launcher can start the server again.

Triton 2.51's Python backend (r24.10) waits for a stub's answer to its initialize request in
windows of one second, and in each window it expects the stub's health thread (which ticks every
0.3 s, in C++, without the GIL) to have ticked. A stub that stalls for a second or more while the
model's `initialize` runs (not given a CPU that long: runs of the suite on two cores starve a thread
up to 9 s; one loaded run met it, docs/reliability.md) fails that check. The backend then judges
the load failed, drops the stub's queues and waits for the stub to exit (StubLauncher::Launch's
cleanup) without killing it; and a stub whose `initialize` then finishes never exits: it waits for
its next command. Each waits for the other; the model stays "loading" and nothing is logged.

`AbandonedStubs.check` finds such a stub (a thread of tritonserver blocked in waitpid on it for
`after` seconds; a stub whose `initialize` failed exits by itself well before) and kills it. The
backend then reports the load failed ("Stub process 'llm_0_0' is not healthy."), tritonserver exits
(--exit-on-error) and `TritonServer.wait_ready` starts it again.

Once the model is up, a stub that stalls a second or more while tritonserver waits on its answer to
an execute request fares worse: tritonserver answers those requests "Stub process 'llm_0_0' is not
healthy.", and then either the stub or tritonserver dies (std::length_error, 2 s of SIGSTOP,
docs/reliability.md). `gone` tells a stub that died; `inflight serve` starts the server again
(`TritonServer.failure`, `restart`).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterable, Optional

from serving import proc_stacks

ABANDONED_AFTER = 10.0  # seconds tritonserver may wait on a live stub to exit before it counts as abandoned
RESTART_INTERVAL = 60.0  # inflight serve exits when a server it started again fails again within this (a crash loop)
RESTARTS = 2  # starts of the server again, each after a stub was found abandoned or a known crash, before wait_ready gives up
# What tritonserver 2.51 prints when it aborts at start in its own code, not a model's: the Python
# backend's shared-memory mutex (upstream: server#5949, #8882; tensorrtllm_backend#349, #521). Met once in
# four runs of `make test-loaded` (docs/reliability.md); wait_ready starts the server again after one.
TRITON_START_CRASHES = ("boost::interprocess::lock_exception",)


def triton_start_crash(log_text: str) -> Optional[str]:
    """The known crash of Triton's own that a log of a server which died before ready shows, if any."""
    return next((mark for mark in TRITON_START_CRASHES if mark in log_text), None)


class AbandonedStubs:
    """The stubs of one tritonserver process that it has been waiting on to exit, and since when."""

    def __init__(self, server_pid: int, after: float = ABANDONED_AFTER):
        self.server_pid = server_pid
        self.after = after
        self.killed: list[int] = []
        self._since: dict[int, float] = {}

    def check(self, stubs: Iterable[int], now: Optional[float] = None) -> list[int]:
        """Kill each of `stubs` that tritonserver has been waiting on for `after` seconds, as seen
        at this and earlier calls; the ones killed now."""
        now = time.monotonic() if now is None else now
        waited = proc_stacks.waiting_for(self.server_pid) & set(stubs)
        self._since = {pid: self._since.get(pid, now) for pid in waited}
        ended = sorted(pid for pid, since in self._since.items() if now - since >= self.after)
        for pid in ended:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            del self._since[pid]
            self.killed.append(pid)
        return ended


def gone(pids: Iterable[int]) -> list[int]:
    """Those of `pids` that are no longer running (exited: a zombie not yet reaped counts)."""
    dead = []
    for pid in pids:
        try:
            state = proc_stacks.stat_fields(Path(f"/proc/{pid}/stat"))[0]
        except (OSError, IndexError):
            state = "X"
        if state in "ZXx":
            dead.append(pid)
    return dead
