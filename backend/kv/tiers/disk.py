"""The disk tier's files: one per block, read and written on a thread of its own. No torch here.

A file is `<kv_disk_cache_dir>/<fingerprint>/<key>.kv`: a header (magic and format version, the
model's fingerprint, the block's key, the payload's length, its CRC-32) and the block's bytes as
the host pool lays them out. A file is loaded only when every field checks: a file torn by a crash
(short, or its bytes not matching the checksum) or written for another model, dtype, block size or
layout (another fingerprint, another key) is deleted and reported, and its block is computed
again. Writes go to a temporary name and are renamed into place, so a reader never sees half a file
under a key's name. The files' modification times keep the LRU order across restarts (a read
touches its file).

The engine thread queues jobs and collects their results (`completed`); reads go before writes, so
a prefix on its way back never waits behind the write-back of evictions.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

MAGIC = b"INFKV\x00\x00\x01"  # the last bytes are the format's version
HEADER = struct.Struct("<8s32s32sQI4x")  # magic, fingerprint, key, payload bytes, crc32
FILE_SUFFIX = ".kv"


class DiskStore:
    def __init__(self, root: str, fingerprint: bytes, block_bytes: int):
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        # a folder per fingerprint: another model's files never count against this one's budget
        self.folder = Path(root) / fingerprint.hex()[:32]
        self.folder.mkdir(parents=True, exist_ok=True)
        self._reads: deque = deque()
        self._others: deque = deque()
        self._done: deque = deque()
        self._busy = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="inflight-kv-disk", daemon=True)
        self._thread.start()

    def path(self, key: bytes) -> Path:
        return self.folder / f"{key.hex()}{FILE_SUFFIX}"

    def scan(self) -> list[bytes]:
        """The keys of the files already here, least recently used first; leftovers of writes a crash
        cut short (a minute old: another instance sharing the folder may be writing one now), and
        files whose size is not a block's, are deleted."""
        found, now = [], time.time()
        for entry in os.scandir(self.folder):
            name = entry.name
            if name.endswith(".tmp") and now - entry.stat().st_mtime < 60:
                continue
            if not name.endswith(FILE_SUFFIX) or entry.stat().st_size != self.file_bytes:
                _unlink(entry.path)
                continue
            try:
                key = bytes.fromhex(name[:-len(FILE_SUFFIX)])
            except ValueError:
                _unlink(entry.path)
                continue
            found.append((entry.stat().st_mtime_ns, key))
        return [key for _, key in sorted(found)]

    # -- jobs (engine thread) -------------------------------------------------------------------
    def read(self, token: Any, key: bytes, dest: Any) -> None:
        """Read key's block into dest (a writable buffer of block_bytes); `completed` reports
        (token, ok, why)."""
        self._queue(self._reads, ("read", token, key, dest))

    def write(self, token: Any, key: bytes, src: Any) -> None:
        self._queue(self._others, ("write", token, key, src))

    def delete(self, key: bytes) -> None:
        self._queue(self._others, ("delete", None, key, None))

    def completed(self) -> list[tuple[Any, bool, str]]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def wait(self, timeout: float) -> None:
        """Block until a job completes (or timeout): the engine has nothing to run until a read lands."""
        with self._cond:
            if not self._done:
                self._cond.wait(timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued job ran; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._reads or self._others or self._busy), timeout)

    @property
    def pending(self) -> int:
        return len(self._reads) + len(self._others) + self._busy

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(10.0)

    def _queue(self, jobs: deque, job: tuple) -> None:
        with self._cond:
            jobs.append(job)
            self._cond.notify_all()

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._reads or self._others)
                if not (self._reads or self._others):
                    return
                job = (self._reads or self._others).popleft()
                self._busy += 1
            kind, token, key, buf = job
            try:
                ok, why = getattr(self, f"_{kind}")(key, buf)
            except OSError as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            with self._cond:
                self._busy -= 1
                if token is not None:
                    self._done.append((token, ok, why))
                self._cond.notify_all()

    def _read(self, key: bytes, dest: Any) -> tuple[bool, str]:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                if len(head) < HEADER.size:
                    return self._reject(path, "torn: short header")
                magic, fingerprint, file_key, length, crc = HEADER.unpack(head)
                if magic != MAGIC or fingerprint != self.fingerprint or file_key != key or length != self.block_bytes:
                    return self._reject(path, "foreign: another model, layout or format")
                got = f.readinto(memoryview(dest))
                if got != length or f.read(1):
                    return self._reject(path, f"torn: {got} of {length} bytes")
        except FileNotFoundError:
            return False, "missing"
        if zlib.crc32(dest) != crc:
            return self._reject(path, "torn: checksum mismatch")
        os.utime(path)  # most recently used, also for the next process
        return True, ""

    def _reject(self, path: Path, why: str) -> tuple[bool, str]:
        log.warning("KV disk tier: %s ignored (%s); its block is computed again", path.name, why)
        _unlink(path)
        return False, why

    def _write(self, key: bytes, src: Any) -> tuple[bool, str]:
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        header = HEADER.pack(MAGIC, self.fingerprint, key, memoryview(src).nbytes, zlib.crc32(src))
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(memoryview(src))
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        return True, ""

    def _delete(self, key: bytes, _: Optional[Any]) -> tuple[bool, str]:
        _unlink(self.path(key))
        return True, ""


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
