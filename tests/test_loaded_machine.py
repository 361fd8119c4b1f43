"""tests/loaded_machine.py (`make test-loaded`): the command's processes are really paused, one that
the command stopped itself stays stopped, and the spinners beside it are gone after."""
import sys

import psutil

import loaded_machine

PROBE = """
import signal, subprocess, sys, time
import psutil
held = subprocess.Popen(["sleep", "30"])
held.send_signal(signal.SIGSTOP)  # as a test that suspends a stub
gap, last, end = 0.0, time.monotonic(), time.monotonic() + 1.5
while time.monotonic() < end:
    time.sleep(0.002)
    now = time.monotonic()
    gap, last = max(gap, now - last), now
print(f"{gap:.3f} {psutil.Process(held.pid).status()}", flush=True)
held.kill()
"""


def test_the_command_is_paused_and_what_it_stopped_stays_stopped(capfd):
    before = {p.pid for p in psutil.Process().children()}
    status, stalls = loaded_machine.run([sys.executable, "-c", PROBE], busy=1, every=0.2, stall_s=(0.08, 0.1))
    gap, state = capfd.readouterr().out.split()
    assert status == 0 and stalls >= 3, (status, stalls)
    assert float(gap) >= 0.08, gap                         # its loop met a stall of at least the shortest
    assert state == psutil.STATUS_STOPPED, state           # the tool did not continue what it had not stopped
    assert {p.pid for p in psutil.Process().children()} == before  # the spinner is gone


def test_the_command_line_wants_a_command_and_returns_its_status():
    assert loaded_machine.main(["--busy", "0", "--every", "5", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    try:
        loaded_machine.main(["--busy", "0"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("no command was refused")
