"""serving/stub_watch.py and proc_stacks.waiting_for: a stub tritonserver waits on to exit, found from
/proc and killed once the wait has lasted `after` seconds (the server is then started again:
tests/e2e/test_reliability.py holds that end to end, with a real stub stalled mid-initialize)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from serving import proc_stacks, stub_watch

WAITER = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
print(child, flush=True)
os.waitpid(child, 0)
"""


@pytest.fixture
def waiter():
    """A process blocked in waitpid on a child of its own that lives on: (its pid, the child's)."""
    proc = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while child not in proc_stacks.waiting_for(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        yield proc.pid, child
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_waiting_for_names_the_child_a_process_is_blocked_in_waitpid_on(waiter):
    parent, child = waiter
    assert proc_stacks.waiting_for(parent) == {child}
    assert proc_stacks.waiting_for(child) == set()  # asleep, not waiting on anyone
    assert proc_stacks.waiting_for(os.getpid()) == set()


def test_a_stub_waited_on_is_killed_only_after_the_wait_has_lasted(waiter):
    parent, child = waiter
    watch = stub_watch.AbandonedStubs(parent, after=5.0)
    assert watch.check([child], now=100.0) == []  # first seen waited on
    assert watch.check([child], now=104.9) == []  # not yet 5 s
    assert watch.check([child + 1], now=106.0) == []  # not one of the stubs given: never killed
    assert watch.check([child], now=106.0) == []  # ...and that call forgot it: the clock starts again
    assert watch.check([child], now=110.9) == []
    assert watch.check([child], now=111.0) == [child]
    assert watch.killed == [child]
    deadline = time.monotonic() + 10
    while child in proc_stacks.waiting_for(parent) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert child not in proc_stacks.waiting_for(parent)  # dead and reaped: the waitpid returned


def test_a_stub_nobody_waits_on_is_left_alone(monkeypatch):
    monkeypatch.setattr(proc_stacks, "waiting_for", lambda pid: set())
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(pid))
    watch = stub_watch.AbandonedStubs(1, after=0.0)
    assert watch.check([2, 3], now=0.0) == [] and watch.check([2, 3], now=50.0) == []
    assert killed == [] and watch.killed == []


def test_gone_names_the_processes_that_exited_and_only_those():
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while stub_watch.gone([exited.pid]) == [] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stub_watch.gone([running.pid, exited.pid]) == [exited.pid]  # a zombie, not yet reaped
        exited.wait()
        assert stub_watch.gone([exited.pid, running.pid]) == [exited.pid]  # reaped: no such process
    finally:
        running.kill()
        running.wait()
