"""Exit when the parent process dies: for a process that must not outlive the one that started it.

Triton's Python backend runs each model in a `triton_python_backend_stub` process that tritonserver
forks. When tritonserver dies abruptly (SIGKILL, a crash), the 2.51 stub does not notice: it lives
on as an orphan holding the model (about 550 MB for the default model, GBs on a GPU). A watchdog
thread compares the parent pid with the one at start: a process whose parent died is re-parented
(to init or a subreaper), so a change means the parent is gone, and the process exits at once.

Not `prctl(PR_SET_PDEATHSIG)`: that signal follows the parent *thread* that forked the process,
and tritonserver forks stubs from worker threads that may end while the server lives on.
No torch, no Triton here.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


def exit_with_parent(interval: float = 0.5, exit: Callable[[int], None] = os._exit) -> threading.Thread:
    """Start the watchdog thread (a daemon) and return it; `exit(1)` runs once the parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        log.error("the parent process (pid %d) is gone: exiting", parent)
        exit(1)

    thread = threading.Thread(target=watch, name="inflight-parent-watch", daemon=True)
    thread.start()
    return thread
