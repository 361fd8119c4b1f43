"""The disk tier's files: one per block, read and written on a thread of its own. No torch here.

A file is `<kv_disk_cache_dir>/<fingerprint>/<key>.kv`, mode 0600 in 0700 folders (folder.py: the
modes, the secret, the lock and the folder's one budget): a header (magic and format version, the
model's fingerprint, the block's key, the payload's length), the block's bytes as the host pool lays
them out, and an HMAC-SHA256 of both keyed by the folder's secret. A file is loaded only when every
field checks: a file torn by a crash (short) or written for another model, dtype, block size or
layout (another fingerprint, another key) is deleted and reported, so is one whose HMAC does not
match (tampered: changed by someone without the folder's secret, or damaged), and its block is
computed again. Files are opened with O_NOFOLLOW relative to the folder's descriptor: a link under a
key's name is deleted, never read. Writes go to a temporary name (0600, O_EXCL) and are renamed into
place under the folder's lock, so a reader never sees half a file under a key's name. The files'
modification times keep the LRU order across restarts and engines (a read touches its file).

The engine thread queues jobs and collects their results (`completed`); reads go before writes, so
a prefix on its way back never waits behind the write-back of evictions. A write that made room in
a full folder also reports the keys of this model's files it deleted (`("gone", key)`).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from backend.kv.tiers.folder import SUFFIX as FILE_SUFFIX
from backend.kv.tiers.folder import DiskFolder
from backend.kv.tiers.nofollow import open_private

log = logging.getLogger(__name__)

MAGIC = b"INFKV\x00\x00\x02"  # the last bytes are the format's version (1: a CRC-32, no HMAC)
HEADER = struct.Struct("<8s32s32sQ")  # magic, fingerprint, key, payload bytes
TAG_BYTES = 32  # HMAC-SHA256 of the header and the payload, after the payload


class DiskStore:
    def __init__(self, root: str, fingerprint: bytes, block_bytes: int, budget: Optional[int] = None):
        """`budget`: kv_disk_cache_bytes, for the whole folder (None: none, a store used alone).
        A folder that cannot be used raises ValueError, one line naming kv_disk_cache_dir."""
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes + TAG_BYTES
        self.dir = DiskFolder(root, fingerprint.hex()[:32], budget)  # a folder per fingerprint
        self.folder = Path(self.dir.path)
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
        """The keys of the files already here, least recently used first (folder.py)."""
        return self.dir.scan(self.file_bytes)

    @property
    def unreadable(self) -> int:
        """Entries of the folder skipped at the scan: links, subfolders, other names, others' files."""
        return self.dir.unreadable

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
        if not self._thread.is_alive():
            self.dir.close()

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
        return self._read_file(self.path(key).name, key, dest)

    def _read_file(self, name: str, key: bytes, dest: Any) -> tuple[bool, str]:
        try:
            fd = open_private(self.dir.fd, name, os.O_RDONLY)
        except FileNotFoundError:
            return False, "missing"  # (another engine's write made room: a miss)
        except OSError as exc:
            return self._reject(name, f"unreadable: {exc.strerror or exc}")
        with open(fd, "rb", closefd=True) as f:
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                return self._reject(name, "torn: short header")
            magic, fingerprint, file_key, length = HEADER.unpack(head)
            if magic != MAGIC or fingerprint != self.fingerprint or file_key != key or length != self.block_bytes:
                return self._reject(name, "foreign: another model, layout or format")
            got = f.readinto(memoryview(dest).cast("B"))
            tag = f.read(TAG_BYTES + 1)
            if got != length or len(tag) != TAG_BYTES:
                return self._reject(name, f"torn: {got} of {length} bytes")
            if not hmac.compare_digest(tag, self._tag(head, dest)):
                return self._reject(name, "tampered: its HMAC does not match the folder's secret")
            os.utime(f.fileno())  # most recently used, also for the next process and the other engines
        return True, ""

    def _tag(self, head: bytes, payload: Any) -> bytes:
        mac = hmac.new(self.dir.secret, head, hashlib.sha256)
        mac.update(memoryview(payload).cast("B"))
        return mac.digest()

    def _reject(self, name: str, why: str) -> tuple[bool, str]:
        log.warning("KV disk tier: %s ignored (%s); its block is computed again", name, why)
        self.dir.delete(name)
        return False, why

    def _write(self, key: bytes, src: Any) -> tuple[bool, str]:
        name = self.path(key).name
        tmp = self._write_tmp(key, src)
        try:
            gone = self.dir.put(tmp, name, self.file_bytes)
        except BaseException:
            self.dir.delete(tmp)
            raise
        if gone:
            with self._cond:
                self._done.extend((("gone", k), True, "") for k in gone)
        return True, ""

    def _write_tmp(self, key: bytes, src: Any) -> str:
        """key's file under a temporary name (0600, O_EXCL; a crash leaves a name the next scan deletes)."""
        tmp = f"{self.path(key).name}.{os.getpid()}.{threading.get_ident()}.tmp"
        head = HEADER.pack(MAGIC, self.fingerprint, key, memoryview(src).nbytes)
        fd = open_private(self.dir.fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            with open(fd, "wb", closefd=True) as f:
                f.write(head)
                f.write(memoryview(src).cast("B"))
                f.write(self._tag(head, src))
        except BaseException:
            self.dir.delete(tmp)
            raise
        return tmp

    def time_read(self, repeats: int = 3) -> float:
        """Seconds to read one block's file and check its HMAC, the best of `repeats`: what a disk
        block costs before its copy to the device (backend/sched/tier_choice.py). Timed at start, on
        the engine thread, on a file written for it under a temporary name and deleted after; the file
        is in the page cache, as a block written recently is (a cold file costs more)."""
        key, payload = bytes(32), bytearray(os.urandom(self.block_bytes))
        tmp, best = self._write_tmp(key, payload), float("inf")
        try:
            for _ in range(repeats):
                started = time.perf_counter()
                ok, why = self._read_file(tmp, key, payload)
                best = min(best, time.perf_counter() - started)
                if not ok:
                    raise OSError(f"the disk tier's timing file did not read back: {why}")
        finally:
            self.dir.delete(tmp)
        return best

    def _delete(self, key: bytes, _: Optional[Any]) -> tuple[bool, str]:
        self.dir.delete(self.path(key).name)
        return True, ""
