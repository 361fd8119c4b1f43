"""The worker processes rank 0 starts on its own machine, and their end.

Each rank 1..N-1 of a local group is `python -m backend.worker.parallel.worker --rank R --device D`, with
the rendezvous address in MASTER_ADDR/MASTER_PORT. Its output goes line by line to rank 0's stderr
(so Triton's log shows every rank), prefixed with the rank, and the last lines are kept for the
error that names a rank that failed. A worker ends with its owner: it watches its parent
(backend/worker/parent_watch.py), `stop` ends it (SIGTERM, then SIGKILL), and a finalizer does the same
when the owner is dropped without `stop` (an `LLM` never closed) or at interpreter exit.
"""
from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Mapping, Optional

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[3]
TAIL_LINES = 20
WORKER_MODULE = "backend.worker.parallel.worker"  # what a worker runs (the GPU rehearsal wraps it in a fake CUDA)


def python_executable() -> str:
    """The interpreter to start workers with: this one (the Triton stub reports the venv's python3,
    found on PATH as `inflight serve` arranges), else python3 on PATH."""
    exe = sys.executable
    if exe and Path(exe).name.startswith("python"):
        return exe
    return shutil.which("python3") or "python3"


class LocalWorkers:
    """Worker processes by rank, their output forwarded and their exit explained."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.tails: dict[int, collections.deque] = {}
        self._finalizer = weakref.finalize(self, _kill, self.procs)

    def start(self, ranks: Mapping[int, str], addr: str, port: int) -> None:
        """Start rank r on device ranks[r] for each r."""
        env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        for rank, device in ranks.items():
            cmd = [python_executable(), "-m", WORKER_MODULE, "--rank", str(rank), "--device", device]
            proc = subprocess.Popen(cmd, env=env, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.procs[rank] = proc
            self.tails[rank] = collections.deque(maxlen=TAIL_LINES)
            threading.Thread(target=self._forward, args=(rank, proc), name=f"inflight-tp-rank{rank}-log",
                             daemon=True).start()
            log.info("tensor-parallel rank %d started (pid %d, %s)", rank, proc.pid, device)

    def _forward(self, rank: int, proc: subprocess.Popen) -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self.tails[rank].append(line)
            print(f"[inflight tp rank {rank}] {line}", file=sys.stderr, flush=True)

    def first_exit(self) -> Optional[int]:
        """The rank of a worker that has exited, if any."""
        return next((r for r, p in self.procs.items() if p.poll() is not None), None)

    def describe(self, rank: int) -> str:
        """How rank `rank` ended, with its last output lines."""
        proc = self.procs[rank]
        code = proc.poll()
        if code is None:
            how = "is still running"
        elif code < 0:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
        else:
            how = f"exited with status {code}"
        if code is None or code < 0:  # killed: what it printed before says nothing about why
            return f"rank {rank} (pid {proc.pid}) {how}"
        time.sleep(0.05)  # let the forwarding thread take the last lines
        tail = [line for line in self.tails[rank] if line.strip()][-6:]
        return f"rank {rank} (pid {proc.pid}) {how}" + ("; its last output:\n  " + "\n  ".join(tail) if tail else "")

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` for the workers to exit (they were told to stop), then end them."""
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _kill(self.procs)


def _kill(procs: Mapping[int, subprocess.Popen]) -> None:
    """SIGTERM every worker still running, SIGKILL those that do not end within 5 s; reap all."""
    alive = [p for p in procs.values() if p.poll() is None]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + 5
    for proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def worker_processes(pid: Optional[int] = None) -> list:
    """The tensor-parallel workers running below process `pid` (default: this one), found by their
    command line; a process that ends while the tree is read (a parent watcher's shell, a worker
    being stopped) is skipped, not an error. For checks that none is left (gpu-check, the tests)."""
    import psutil

    found = []
    for proc in psutil.Process(pid or os.getpid()).children(recursive=True):
        try:
            if WORKER_MODULE in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:  # gone (or a zombie) since the listing
            continue
    return found
