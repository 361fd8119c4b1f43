"""Names under a folder's descriptor, never through a symbolic link: what the disk tier's folder
(folder.py) and files (disk.py) are opened, listed and deleted with. No torch here.

Every call takes the descriptor of a folder already opened this way and a name in it: `O_NOFOLLOW`
on the last component (a link there is an error, ELOOP, never followed), `unlink` and `lstat` (a
link is the link itself), `O_NONBLOCK` on files (a FIFO put in the folder never blocks an open).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from typing import Iterator, Optional

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
refused = functools.partial(OSError, errno.EPERM)  # a refusal of ours, an OSError like the system's


def own(fd: int, mode: Optional[int]) -> os.stat_result:
    """The entry must be this process's user's; its mode is set to `mode` (None: left as it is)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise refused(f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
    if mode is not None and stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)
    return st


def open_private(dir_fd: int, name: str, flags: int) -> int:
    """A regular file of ours in the folder of dir_fd, mode 0600 (given when made, then set with fchmod:
    no umask widens it)."""
    fd = os.open(name, flags | FILE_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(own(fd, 0o600).st_mode):
            raise refused("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def entries(dir_fd: int) -> Iterator[tuple[str, Optional[os.stat_result]]]:
    """(name, lstat or None when it cannot be read) of a folder's entries; one deleted meanwhile
    (another engine's) is left out."""
    with os.scandir(dir_fd) as it:
        for entry in it:
            try:
                yield entry.name, entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError:
                yield entry.name, None


@contextlib.contextmanager
def subfolder(dir_fd: int, name: str) -> Iterator[int]:
    """A subfolder's descriptor; -1 when it cannot be opened (a link, a file, gone)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        yield -1
        return
    try:
        yield fd
    finally:
        os.close(fd)


def unlink(dir_fd: int, name: str) -> Optional[os.stat_result]:
    """Delete a name (a link itself, never its target); what it was (lstat), None when it was gone."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    return st
