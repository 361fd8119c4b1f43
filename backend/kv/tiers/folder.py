"""The disk tier's folder, `kv_disk_cache_dir`: who may read and write it, the secret its files are
signed with, and the lock and the one budget of the engines that share it. No torch here.

- the folder: 0700, the engine's user's. An existing one is set to 0700 when it holds only the
  tier's entries (an earlier version's 0755 folder); one others may write (/tmp), one holding other
  things under a wider mode, another user's, or a symbolic link is refused, never changed;
- `.lock` (0600): flock'd while the folder changes (a file put in place or deleted, the scan at start);
- `.secret` (0600): 32 random bytes made at first use (written under a name of its own with O_EXCL,
  then linked into place), the HMAC-SHA256 key of every block file (disk.py);
- `.usage` (0600): the bytes of the block files of the whole folder;
- `<fingerprint>/` (0700): one model's files, `<key>.kv`, 0600 (disk.py).

Modes are given when a name is made and set again with fchmod, so no umask widens them. Every name is
opened relative to its folder's descriptor with O_NOFOLLOW (nofollow.py): no symbolic link in the
folder is followed, and nothing outside it is read, written or deleted. An entry the tier does not make (a
link, a subfolder, another name, a file of another user) is skipped and counted, never deleted.

Several engines (a config's instances, other models) may share the folder, `kv_disk_cache_bytes` the
whole folder's budget: under the lock each file put in place is added to `.usage`, each one deleted
taken off, and one that would pass the budget first deletes the folder's least recently used files
(any model's, by mtime: a read touches its file) down to 7/8 of it. `.usage` is counted at each start.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import threading
import time
from typing import Iterator, Optional

from backend.kv.tiers.nofollow import DIR_FLAGS, entries, open_private, own, refused, subfolder, unlink

log = logging.getLogger(__name__)

LOCK, SECRET, USAGE = ".lock", ".secret", ".usage"
SECRET_BYTES = 32
SUFFIX = ".kv"
BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.kv")
TMP_NAME = re.compile(r"[0-9a-f]{64}\.kv\.[0-9]+\.[0-9]+\.tmp")
MODEL_DIR_NAME = re.compile(r"[0-9a-f]{32}")
TMP_SECONDS = 60  # a temporary file younger than this may be another engine's write in progress
LOW_WATER = 7 / 8  # a full folder is emptied down to this share of its budget at once
TIER_NAMES = re.compile(r"\.lock|\.secret|\.usage|\.secret\.[0-9]+\.[0-9a-f]+\.tmp|[0-9a-f]{32}")


class DiskFolder:
    """The folder of one engine's disk tier: `fd` is its model's subfolder, `secret` the HMAC key.
    `budget` None: no budget for the folder (a store used alone, in tests)."""

    def __init__(self, root: str, name: str, budget: Optional[int]):
        self.root, self.budget = os.path.abspath(root), budget
        self.path = os.path.join(self.root, name)
        self.unreadable = 0  # entries skipped: links, subfolders, other names, other users' files
        self.root_fd = self.lock_fd = self.usage_fd = self.fd = -1
        self._mutex = threading.Lock()
        at = self.root
        try:
            self.root_fd = _open_root(self.root)
            at = os.path.join(self.root, LOCK)
            self.lock_fd = open_private(self.root_fd, LOCK, os.O_RDWR | os.O_CREAT)
            with self.locked():
                at = os.path.join(self.root, SECRET)
                self.secret = _secret(self.root_fd)
                at = os.path.join(self.root, USAGE)
                self.usage_fd = open_private(self.root_fd, USAGE, os.O_RDWR | os.O_CREAT)
                at = self.path
                self.fd = self._model_dir(name)
        except OSError as exc:
            self.close()
            where = f" ({exc.filename})" if isinstance(exc.filename, str) and exc.filename.startswith("/") else ""
            raise ValueError(f"kv_disk_cache_dir: cannot use {at}: {exc.strerror or exc}{where}") from None

    def _model_dir(self, name: str) -> int:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=self.root_fd)
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            # a link or a file under this model's name, in a folder only this user writes: the entry
            # itself is replaced (unlink takes a link away, not what it points to), never followed
            log.warning("KV disk tier: %s is not a folder (%s); replaced by one", self.path, exc.strerror)
            self.unreadable += 1
            os.unlink(name, dir_fd=self.root_fd)
            os.mkdir(name, 0o700, dir_fd=self.root_fd)
            fd = os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
        own(fd, 0o700)
        return fd

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The folder to this thread: the flock keeps other processes out (it is the open file's), the mutex threads."""
        with self._mutex:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.lock_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for attr in ("fd", "usage_fd", "lock_fd", "root_fd"):
            if getattr(self, attr) >= 0:
                os.close(getattr(self, attr))
                setattr(self, attr, -1)

    # -- at start -----------------------------------------------------------------------------------
    def scan(self, file_bytes: int) -> list[bytes]:
        """The keys of this model's files, least recently used first. Files of the tier that cannot
        be whole (another size: a crash cut them short, or another format) and temporary files a
        minute old are deleted; any other entry is skipped and counted (`unreadable`)."""
        found, now = [], time.time()
        with self.locked():
            for name, st in entries(self.fd):
                if st is None or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    self.unreadable += 1
                elif BLOCK_NAME.fullmatch(name) and st.st_size == file_bytes:
                    found.append((st.st_mtime_ns, bytes.fromhex(name[:-len(SUFFIX)])))
                elif BLOCK_NAME.fullmatch(name) or (TMP_NAME.fullmatch(name) and now - st.st_mtime >= TMP_SECONDS):
                    unlink(self.fd, name)
                elif not TMP_NAME.fullmatch(name):
                    self.unreadable += 1
            self._set_usage(sum(size for *_, size in self._all_files()))
        if self.unreadable:
            log.warning("KV disk tier: %d entries in %s skipped (links, folders, other names or users' files)",
                        self.unreadable, self.root)
        return [key for _, key in sorted(found)]

    # -- the disk thread's changes, each under the lock ---------------------------------------------
    def put(self, tmp: str, name: str, size: int) -> list[bytes]:
        """Rename this model's written `tmp` to `name`, within the folder's budget. Returns the keys
        of this model's files deleted to make room (the engine forgets them)."""
        with self.locked():
            try:
                old = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                size -= old.st_size if stat.S_ISREG(old.st_mode) else 0
            except FileNotFoundError:
                pass
            usage, gone = self._usage(), []
            if self.budget is not None and usage + size > self.budget:
                usage, gone = self._make_room(size, keep=name)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)  # (replaces a link, never writes through it)
            self._set_usage(usage + size)
        return gone

    def delete(self, name: str) -> None:
        with self.locked():
            size = _block_bytes(unlink(self.fd, name), name)
            if size:
                self._set_usage(self._usage() - size)

    def _make_room(self, size: int, keep: str) -> tuple[int, list[bytes]]:
        """Delete the folder's least recently used files, any model's, until `size` more bytes leave
        it at LOW_WATER of its budget; returns the folder's bytes left and this model's keys deleted."""
        files = sorted(self._all_files())
        usage, gone = sum(f[-1] for f in files), []
        name = os.path.basename(self.path)
        for _, folder, file, _size in files:
            if usage + size <= self.budget * LOW_WATER:
                break
            if (folder, file) == (name, keep):
                continue
            if folder == name:
                freed = _block_bytes(unlink(self.fd, file), file)
                gone.append(bytes.fromhex(file[:-len(SUFFIX)]))
            else:
                with subfolder(self.root_fd, folder) as fd:
                    freed = _block_bytes(unlink(fd, file), file) if fd >= 0 else 0
            usage -= freed
        return usage, gone

    def _all_files(self) -> Iterator[tuple[int, str, str, int]]:
        """(modification time, model folder, name, bytes) of every block file of the folder."""
        for folder, st in entries(self.root_fd):
            if st is None or not stat.S_ISDIR(st.st_mode) or not MODEL_DIR_NAME.fullmatch(folder):
                continue
            with subfolder(self.root_fd, folder) as fd:
                for name, fst in entries(fd) if fd >= 0 else ():
                    if fst is not None and stat.S_ISREG(fst.st_mode) and BLOCK_NAME.fullmatch(name):
                        yield fst.st_mtime_ns, folder, name, fst.st_size

    def _usage(self) -> int:
        try:
            return int(os.pread(self.usage_fd, 32, 0) or b"0")
        except ValueError:  # not a number: counted again
            return sum(size for *_, size in self._all_files())

    def _set_usage(self, usage: int) -> None:
        os.pwrite(self.usage_fd, b"%020d" % max(0, usage), 0)  # fixed width: a torn write is still a number


def _open_root(root: str) -> int:
    parent = os.path.dirname(root)
    try:
        os.makedirs(parent, exist_ok=True)  # the folders above it are the operator's
    except FileExistsError:
        raise OSError(errno.ENOTDIR, f"{parent} is not a folder") from None
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    if os.path.islink(root):
        raise refused("a symbolic link (the disk tier follows none: name the folder itself)")
    fd = os.open(root, DIR_FLAGS)
    try:
        mode = stat.S_IMODE(own(fd, None).st_mode)
        if mode & 0o022:  # /tmp, a shared folder: never made private under its other users
            raise refused(f"mode {mode:o}: others may write it (give the tier a folder of its own: it is made 0700)")
        strays = [name for name, _ in entries(fd) if not TIER_NAMES.fullmatch(name)]
        if mode != 0o700 and strays:
            raise refused(f"mode {mode:o}, and it holds more than the tier ({strays[0]}): give the tier a folder of "
                          "its own (it is made 0700)")
        own(fd, 0o700)  # an earlier version's 0755 folder
    except BaseException:
        os.close(fd)
        raise
    return fd


def _secret(dir_fd: int) -> bytes:
    """The folder's HMAC key, made by the first engine to use the folder (under the lock)."""
    try:
        fd = open_private(dir_fd, SECRET, os.O_RDONLY)
    except FileNotFoundError:
        tmp = f"{SECRET}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        fd = open_private(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, secrets.token_bytes(SECRET_BYTES))
            os.fsync(fd)
            os.link(tmp, SECRET, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(fd)
            os.unlink(tmp, dir_fd=dir_fd)
        fd = open_private(dir_fd, SECRET, os.O_RDONLY)
    try:
        key = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != SECRET_BYTES:
        raise OSError(errno.EINVAL, f"{len(key)} bytes, not {SECRET_BYTES} (without it no file here can be "
                                    "checked: delete the folder)")
    return key



def _block_bytes(st: Optional[os.stat_result], name: str) -> int:
    """The bytes of a block file deleted (what `.usage` counts), 0 for anything else."""
    return st.st_size if st is not None and stat.S_ISREG(st.st_mode) and BLOCK_NAME.fullmatch(name) else 0
