"""backend/worker/parent_watch.py's outside watcher: a process whose every thread is starved of the GIL (as
a stub blocked in an IPC call to a dead tritonserver is) still dies with its parent, and the
watcher leaves with the process it watched."""
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SPINNER = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from backend.worker.parent_watch import kill_when_orphaned
kill_when_orphaned(os.getpid(), os.getppid(), 0.1)
print(os.getpid(), flush=True)
if sys.argv[1] == "spin":
    while True:
        pass  # the GIL is never given up: no watchdog thread in here could run
"""
MIDDLE = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {SPINNER!r}, sys.argv[1]])
time.sleep(60)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait(predicate, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def watchers_of(pid: int) -> list:
    return [p for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [])[-2:-1] == [str(pid)] and "inflight-parent-watch" in p.info["cmdline"]]


def test_a_gil_starved_process_dies_with_its_parent_and_its_watcher_leaves():
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, "spin"], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    assert wait(lambda: len(watchers_of(child)) == 1)
    time.sleep(0.3)
    assert not gone(child)                      # its parent lives: left alone
    middle.kill()
    middle.wait()
    assert wait(lambda: gone(child), timeout=3), "the orphan lived on"
    assert wait(lambda: not watchers_of(child), timeout=3)


def test_the_watcher_ends_when_the_process_ends_on_its_own():
    proc = subprocess.Popen([sys.executable, "-c", SPINNER, "exit"], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    assert proc.wait(10) == 0
    assert wait(lambda: not watchers_of(pid), timeout=3)
