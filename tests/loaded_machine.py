"""A command run as on a loaded machine (`make test-loaded`): the suite's check for tests that time
something they do not control. CI runs on a shared 2-core machine whose processes wait for a CPU now
and then for a tenth of a second or more (one replay-flood event took 209 ms while its thread was busy
7% of the time); a test that fails there only is a bug to find, and this finds them here first.

Two kinds of load, beside the command (which starts the processes this tool acts on):
- contention: `--busy N` processes spinning on the CPUs, so each of the command's threads waits its
  turn (a race between a thread and the GIL shows here);
- stalls: every `--every` seconds on average, every process of the command's tree is stopped
  (SIGSTOP) for `--stall` seconds and continued, as a VM's host or a CPU quota pauses the guest's
  work. A process the command itself stopped (state T: a test that suspends a stub) is left alone,
  so the stall tests keep their own.

    python tests/loaded_machine.py --busy 1 -- make test
"""
from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import time

import psutil


def tree(root: psutil.Process) -> list[psutil.Process]:
    """The command and its descendants that are not stopped already (by anything but this tool)."""
    out = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            if proc.status() != psutil.STATUS_STOPPED:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def stall(procs: list[psutil.Process], seconds: float) -> int:
    """Stop every process, wait, continue those stopped here; how many were stopped."""
    stopped = []
    for proc in procs:
        try:
            proc.send_signal(signal.SIGSTOP)
            stopped.append(proc)
        except psutil.Error:
            continue
    try:
        time.sleep(seconds)
    finally:  # an interrupted tool leaves nothing stopped
        for proc in stopped:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.Error:
                continue
    return len(stopped)


def run(command: list[str], busy: int, every: float, stall_s: tuple[float, float], seed: int = 0) -> tuple[int, int]:
    """(the command's exit status, how many stalls it met)."""
    rng = random.Random(seed)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    child = subprocess.Popen(command)
    stalls = 0
    try:
        root = psutil.Process(child.pid)
        while True:
            try:
                return child.wait(timeout=rng.uniform(0.5 * every, 1.5 * every)), stalls
            except subprocess.TimeoutExpired:
                stalls += stall(tree(root), rng.uniform(*stall_s)) > 0
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=1, help="processes spinning beside the command (default 1)")
    parser.add_argument("--every", type=float, default=1.75, help="mean seconds between stalls (default 1.75)")
    parser.add_argument("--stall", type=float, nargs=2, default=(0.1, 0.3), metavar=("MIN", "MAX"),
                        help="each stall's length, uniform in seconds (default 0.1 0.3)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    start = time.monotonic()
    status, stalls = run(command, args.busy, args.every, tuple(args.stall))
    print(f"loaded_machine: {' '.join(command)} exited {status} after {time.monotonic() - start:.0f} s, "
          f"{stalls} stalls, {args.busy} busy process(es) beside it", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
