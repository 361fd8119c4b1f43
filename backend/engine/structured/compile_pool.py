"""Constraints compiled off the request path, in worker processes that can be abandoned.

A constraint new to the engine's cache is a `CompileJob` handed to the process-wide `CompilePool`
(`shared_pool()`); its future completes on a pool thread, never on Triton's `execute` thread or the
engine's step. Each pool thread owns at most one worker process (compile_worker.py), started the
first time it is needed (`python -m`, like the tensor-parallel workers): up to `MAX_WORKERS`,
one compile at a time each.

Two clocks bound a job, each `timeout` seconds long (the engine's
`structured_outputs_compile_timeout_s`):
- waiting for a worker: past it the job is refused as busy (`GrammarCompilerBusy`, a 429/503: the
  compiler is taken by other constraints), never compiled;
- compiling: past it the worker is killed (SIGKILL: xgrammar cannot be interrupted, and a hostile
  schema may compile for minutes) and the job refused naming the limit (a 400). A new worker
  starts for the next job.
A worker's start-up (it imports xgrammar, torch and transformers: seconds) counts against neither.

Why processes and not threads: xgrammar releases the GIL, so a thread would not stall the engine,
but a runaway compile on a thread could only be waited out. No torch here (the workers import it).
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import select
import struct
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from backend.core.errors import QueueFullError

MAX_WORKERS = 2  # each holds xgrammar, torch and transformers (~300 MB): started only when needed
START_TIMEOUT_S = 120.0  # the worker's imports, on a loaded machine
FRAME = struct.Struct("<II")  # header bytes, payload bytes
REPO_ROOT = Path(__file__).resolve().parents[3]


class GrammarCompilerBusy(QueueFullError):
    """No worker took the constraint within the timeout: other constraints hold every worker."""


class CompileFailed(ValueError):
    """The constraint is refused: xgrammar's error, the compile timeout, or a worker crash on it."""


@dataclass
class CompileJob:
    """One constraint to compile. `tokenizer` (compiler.GrammarTokenizer): its `key`, `vocab_size`,
    `stop_token_ids` and `json()`, xgrammar's TokenizerInfo as JSON, built on the first job that
    needs it; `where`: the field errors name (structured_outputs.json); the future's result is
    `finish(payload, allowed, completed)`, run on the pool thread."""
    where: str
    kind: str
    source: str
    any_whitespace: bool
    tokenizer: Any
    timeout: float
    finish: Callable[[bytes, bool, bool], Any]
    submitted: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)


def write_frame(stream, head: dict, payload: bytes = b"") -> None:
    data = json.dumps(head).encode("utf-8")
    stream.write(FRAME.pack(len(data), len(payload)) + data)
    if payload:
        stream.write(payload)
    stream.flush()


def read_frame(stream) -> Optional[tuple[dict, bytes]]:
    """The next frame of a blocking stream; None at its end."""
    def exactly(n: int) -> Optional[bytes]:
        parts, left = [], n
        while left:
            got = stream.read(left)
            if not got:
                return None
            parts.append(got)
            left -= len(got)
        return b"".join(parts)

    sizes = exactly(FRAME.size)
    if sizes is None:
        return None
    head_len, payload_len = FRAME.unpack(sizes)
    head, payload = exactly(head_len), exactly(payload_len) if payload_len else b""
    if head is None or payload is None:
        return None
    return json.loads(head), payload


class _Worker:
    """One worker process and the pipe ends this side holds."""

    def __init__(self) -> None:
        from backend.worker.parallel.launcher import python_executable

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.setdefault("OMP_NUM_THREADS", "1")  # it imports torch and never computes with it
        self.proc = subprocess.Popen([python_executable(), "-m", "backend.engine.structured.compile_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env,
                                     cwd=str(REPO_ROOT))
        self.fd = self.proc.stdout.fileno()
        self.tokenizers: set[str] = set()
        try:
            head = self.receive(START_TIMEOUT_S)
        except TimeoutError:
            head = None
        if head is None or not head[0].get("ready"):
            self.kill()
            raise RuntimeError(f"the grammar compiler process did not start ({self.exit_text()})")

    def send(self, head: dict, payload: bytes = b"") -> None:
        write_frame(self.proc.stdin, head, payload)

    def receive(self, timeout: float) -> Optional[tuple[dict, bytes]]:
        """The next frame; None when the process ended (its pipe closed); TimeoutError when nothing
        came within `timeout` s."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            raise TimeoutError
        frame = read_frame(_FdReader(self.fd))
        if frame is None:
            try:
                self.proc.wait(5)  # its pipe closed first: let it be reaped, for exit_text
            except subprocess.TimeoutExpired:
                pass
        return frame

    def exit_text(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class _FdReader:
    def __init__(self, fd: int):
        self.fd = fd

    def read(self, n: int) -> bytes:
        return os.read(self.fd, n)


class CompilePool:
    def __init__(self, max_workers: int = MAX_WORKERS):
        self.max_workers = max_workers
        self._cv = threading.Condition()
        self._jobs: collections.deque[CompileJob] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self._workers: list[_Worker] = []
        self.num_killed = 0  # workers ended for running past a job's timeout

    def submit(self, job: CompileJob) -> Future:
        with self._cv:
            if self._closed:
                raise RuntimeError("the grammar compile pool is closed")
            self._jobs.append(job)
            if self._idle == 0 and len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._serve, name=f"inflight-grammar-{len(self._threads)}",
                                          daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cv.notify()
        return job.future

    def close(self) -> None:
        with self._cv:
            self._closed = True
            jobs, self._jobs = list(self._jobs), collections.deque()
            workers = list(self._workers)
            self._cv.notify_all()
        for job in jobs:
            job.future.cancel()
        for worker in workers:
            worker.kill()

    # -- a pool thread ------------------------------------------------------------------------------
    def _next_job(self) -> Optional[CompileJob]:
        with self._cv:
            self._idle += 1
            while not self._jobs and not self._closed:
                self._cv.wait()
            self._idle -= 1
            return None if self._closed else self._jobs.popleft()

    def _serve(self) -> None:
        worker: Optional[_Worker] = None
        ready_at = 0.0
        while True:
            job = self._next_job()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue  # its request was aborted while it waited
            try:
                if worker is not None and worker.proc.poll() is not None:  # died while idle (OOM killer)
                    self._drop(worker)
                    worker = None
                if worker is None:
                    worker = _Worker()
                    ready_at = time.monotonic()
                    with self._cv:
                        self._workers.append(worker)
                waited = time.monotonic() - max(job.submitted, ready_at)
                if waited > job.timeout:
                    raise GrammarCompilerBusy(
                        f"{job.where}: compile queue full: waited {waited:.1f} s for the grammar compiler, "
                        f"busy with other constraints (structured_outputs_compile_timeout_s is {job.timeout:g}); "
                        "retry later")
                job.future.set_result(self._compile(worker, job))
            except BaseException as exc:
                job.future.set_exception(exc)
            if worker is not None and worker.proc.poll() is not None:  # killed or crashed: a new one next time
                self._drop(worker)
                worker = None

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._cv:
            if worker in self._workers:
                self._workers.remove(worker)

    def _compile(self, worker: _Worker, job: CompileJob) -> Any:
        tok = job.tokenizer
        if tok.key not in worker.tokenizers:  # set up before the compile's clock starts
            worker.send({"op": "tokenizer", "key": tok.key}, tok.json())
            try:
                loaded = worker.receive(START_TIMEOUT_S)
            except TimeoutError:
                loaded = None
            if loaded is None:
                worker.kill()
                raise RuntimeError(f"the grammar compiler process failed to load the tokenizer ({worker.exit_text()})")
            worker.tokenizers.add(tok.key)
        worker.send({"op": "compile", "key": tok.key, "kind": job.kind, "source": job.source,
                     "any_whitespace": job.any_whitespace, "vocab_size": tok.vocab_size,
                     "stop_token_ids": list(tok.stop_token_ids)})
        try:
            frame = worker.receive(job.timeout)
        except TimeoutError:  # still compiling: abandon it
            worker.kill()
            self.num_killed += 1
            raise CompileFailed(f"{job.where}: not compiled within {job.timeout:g} s "
                                "(structured_outputs_compile_timeout_s): simplify it (less nesting, fewer "
                                "optional properties or alternatives) or raise the limit") from None
        if frame is None:
            raise CompileFailed(f"{job.where}: the grammar compiler crashed on it ({worker.exit_text()})")
        head, payload = frame
        if not head["ok"]:
            raise CompileFailed(f"{job.where}: cannot be compiled: {head['error']}")
        return job.finish(payload, head["allowed"], head["completed"])


_shared: Optional[CompilePool] = None
_shared_lock = threading.Lock()


def shared_pool() -> CompilePool:
    """The process's pool: every engine of the process shares its workers (each worker keeps one
    xgrammar compiler per tokenizer)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CompilePool()
            atexit.register(_shared.close)
        return _shared
