"""Exit when the parent process dies: for a process that must not outlive the one that started it.
(And `stacks_on_request`: the stub's Python stacks to its log on SIGUSR1.)

Triton's Python backend runs each model in a `triton_python_backend_stub` process that tritonserver
forks. When tritonserver dies abruptly (SIGKILL, a crash), the 2.51 stub does not notice: it lives
on as an orphan holding the model (about 550 MB for the default model, GBs on a GPU). A watchdog
thread compares the parent pid with the one at start: a process whose parent died is re-parented
(to init or a subreaper), so a change means the parent is gone, and the process exits at once.

Not `prctl(PR_SET_PDEATHSIG)`: that signal follows the parent *thread* that forked the process,
and tritonserver forks stubs from worker threads that may end while the server lives on.

A thread alone is not enough: it needs the GIL to notice, and a stub thread blocked in a pb_utils
call (a metric's set, a response's send: an IPC round trip to the dead server) holds the GIL
forever; the orphan lived on in about half of the kill -9 runs once the engine published more
metrics. So a `/bin/sh` loop beside the process (its child, no GIL, no Python) does the same check
from outside and sends SIGKILL; the thread stays the quick, logged exit when the GIL is free.
No torch, no Triton here.
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Callable, Optional

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
    kill_when_orphaned(os.getpid(), parent, interval)
    return thread


# $1 the watched pid, $2 its parent's. After the ")" that ends the command name in /proc/PID/stat
# (a name may hold spaces) come the fields from 3 on, so field N lands in $N: $4 the parent, ${22}
# the start time, which tells the watched process from a later one given the same pid. A zombie
# keeps its entry until it is reaped.
WATCH_SCRIPT = """
start=
while [ -r /proc/$1/stat ]; do
  stat=$(cat /proc/$1/stat 2>/dev/null) || exit 0
  set -- "$1" "$2" ${stat##*) }
  [ -n "$start" ] || start=${22}
  [ "${22}" = "$start" ] || exit 0
  [ "$4" = "$2" ] || { kill -9 "$1" 2>/dev/null; exit 0; }
  sleep "$WATCH_INTERVAL"
done
"""


def kill_when_orphaned(pid: int, parent: int, interval: float = 0.5) -> Optional[subprocess.Popen]:
    """Start the outside watcher of `pid` (a `/bin/sh` child): SIGKILL once its parent is no longer
    `parent`; it ends by itself when `pid` does. None where there is no /bin/sh or /proc."""
    if not (os.path.exists("/bin/sh") and os.path.exists(f"/proc/{pid}/stat")):
        log.warning("no /bin/sh or /proc: only the in-process watch ends this process with its parent")
        return None
    return subprocess.Popen(["/bin/sh", "-c", WATCH_SCRIPT, "inflight-parent-watch", str(pid), str(parent)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={"PATH": "/usr/bin:/bin", "WATCH_INTERVAL": str(interval)}, close_fds=True)


def stacks_on_request() -> None:
    """Every thread's Python stack to stderr (a stub's: Triton's log) on SIGUSR1, the process going
    on: serving/triton_launcher.py `TritonServer.dump_stub_stacks` asks when a model's load outlasts
    its wait, so the log says where it stands. Called from initialize; a stub signalled before then
    dies of it (SIGUSR1's default), which the log shows too."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)
