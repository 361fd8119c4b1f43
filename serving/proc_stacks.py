"""Where a process's threads stand, read from /proc without a debugger: for a tritonserver whose
model load never finishes (TritonServer.wait_ready appends it to its timeout error).

Per thread: name, state, the kernel function it waits in, the system call it is blocked in with
the mapping its first argument points into (a futex in /dev/shm/triton_python_backend_shm_region_*
is one of the Python backend's queues or its health mutex; one in [heap] or an anonymous mapping is
a lock of the process's own), and a scan of its user stack: every word that points into an
executable file mapping, as `library+0xoffset` (the offset within the file), named by binutils'
`addr2line` where it is installed (the wheel's libraries carry their symbols' names). That is not an
unwound backtrace (stale words show up too) but it names the code a blocked thread came through. No
gdb, no ptrace: reading /proc/PID/mem needs the rights an ancestor of the process has.

And a process's Python stacks, asked for by signal (`ask_python_stacks`: the stubs register
faulthandler on SIGUSR1). Also the process tree the launcher and the stub watch look at: a
process's children, tritonserver's stubs among them, the children a thread waits for (`waiting_for`).
"""
from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

SYSCALLS = {0: "read", 7: "poll", 23: "select", 35: "nanosleep", 202: "futex", 232: "epoll_wait",
            230: "clock_nanosleep", 61: "wait4", 271: "ppoll", 281: "epoll_pwait",
            219: "restart_syscall"}  # x86_64 numbers; restart_syscall: a wait resumed after a stop signal
WAIT4 = {"x86_64": 61, "aarch64": 260}  # waitpid's system call, by machine
STACK_BYTES = 16384
FRAMES = 12


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    executable: bool
    offset: int
    path: str

    def describe(self, address: int) -> str:
        return _where(self.path or "anonymous", address - self.start + self.offset)


def _where(path: str, offset: int) -> str:
    """`library+0xoffset` ([heap]+0x.. for a mapping with no file)."""
    return f"{os.path.basename(path) if path.startswith('/') else path}+{offset:#x}"


def mappings(pid: int) -> list[Mapping]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append(Mapping(start, end, "x" in parts[1], int(parts[2], 16), parts[5] if len(parts) > 5 else ""))
    return out


def _find(maps: list[Mapping], address: int) -> Optional[Mapping]:
    for m in maps:
        if m.start <= address < m.end:
            return m
    return None


def stack_code(pid: int, sp: int, maps: list[Mapping], size: int = STACK_BYTES,
               limit: int = FRAMES) -> list[tuple[str, int]]:
    """The words on a thread's stack from `sp` up that point into executable file mappings, in
    order, each as (library path, offset in the file): return addresses, and some stale ones."""
    region = _find(maps, sp)
    if region is None:
        return []
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            mem.seek(sp)
            data = mem.read(min(size, region.end - sp))
    except (OSError, ValueError, OverflowError):
        return []
    frames = []
    for i in range(0, len(data) - 7, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        m = _find(maps, word) if word > 0x10000 else None
        if m is not None and m.executable and m.path.startswith("/"):
            frames.append((m.path, word - m.start + m.offset))
            if len(frames) == limit:
                break
    return frames


def symbols(frames: Iterable[tuple[str, int]], timeout: float = 20.0) -> dict[tuple[str, int], str]:
    """Function names of (library, offset) pairs, by `addr2line -f -C` once per library (the
    libraries here are position-independent with their code at its file offsets); {} without
    binutils. A name it cannot find is left out."""
    tool = shutil.which("addr2line")
    by_path: dict[str, list[int]] = {}
    for path, offset in set(frames):
        by_path.setdefault(path, []).append(offset)
    names = {}
    for path, offsets in by_path.items() if tool else ():
        try:
            out = subprocess.run([tool, "-f", "-C", "-e", path, *(hex(o) for o in offsets)], capture_output=True,
                                 text=True, timeout=timeout).stdout.splitlines()
        except (OSError, subprocess.SubprocessError):
            continue
        for offset, name in zip(offsets, out[0::2]):
            if name and name != "??":
                names[(path, offset)] = name
    return names


def _thread(pid: int, task: Path, maps: list[Mapping]) -> tuple[str, list[tuple[str, int]]]:
    """A thread's line without its stack, and its stack's code addresses."""
    stat = (task / "stat").read_text()
    name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()[0]
    line = f"{pid}/{task.name} {name} {state} {(task / 'wchan').read_text() or '-'}"
    try:
        fields = (task / "syscall").read_text().split()
    except OSError:
        return line, []
    if len(fields) < 9:  # "running", or -1 with only the stack and instruction pointers
        return f"{line} syscall={fields[0] if fields else '?'}", []
    nr, arg0, sp = int(fields[0]), int(fields[1], 16), int(fields[7], 16)
    target = _find(maps, arg0)
    line += f" syscall={SYSCALLS.get(nr, nr)}"
    if target is not None:
        line += f" arg0={target.describe(arg0)}"
    return line, stack_code(pid, sp, maps)


def stat_fields(stat_path: Path) -> list[str]:
    """The fields of a /proc/<pid>/stat (or a task's) after the command name: [state, ppid, ...]."""
    return stat_path.read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """The pids of the processes `pid` started that are alive (tritonserver's stubs)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(stat_fields(entry / "stat")[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def stubs(pid: int) -> list[int]:
    """The pids of tritonserver `pid`'s Python-backend stubs."""
    found = []
    for child in children(pid):
        try:
            if "python_backend_stub" in Path(f"/proc/{child}/cmdline").read_text():
                found.append(child)
        except OSError:
            continue
    return found


def waiting_for(pid: int) -> set[int]:
    """The children some thread of process `pid` is blocked waiting for by number (waitpid(child,
    ...), the wait4 system call): a tritonserver waiting for a stub to exit. Empty where /proc does
    not say (a machine not in WAIT4, no rights to read a thread's system call)."""
    number = WAIT4.get(platform.machine())
    found: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir()) if number is not None else []
    except OSError:
        return found
    for task in tasks:
        try:
            fields = (task / "syscall").read_text().split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] == str(number):
            child = int(fields[1], 16)
            if 0 < child < 1 << 31:  # -1 (any child) reads as 0xffff...; not one process
                found.add(child)
    return found


def report(pids: Iterable[int]) -> str:
    """`thread_states` under a header line, for an error message."""
    return "\n".join(["\n--- threads (pid/tid name state wchan syscall arg0 stack) ---", *thread_states(pids)])


def thread_states(pids: Iterable[int]) -> list[str]:
    """One line per thread of each process (pid/tid name state wchan syscall arg0 stack), each code
    address on the stack as library+0xoffset, with its function's name where addr2line finds it."""
    threads = []
    for pid in pids:
        try:
            maps = mappings(pid)
            tasks = sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda t: int(t.name))
        except (OSError, ValueError):
            continue
        for task in tasks:
            try:
                threads.append(_thread(pid, task, maps))
            except (OSError, ValueError, IndexError):
                continue
    names = symbols(f for _, frames in threads for f in frames)

    def frame(path: str, offset: int) -> str:
        where = _where(path, offset)
        return f"{names[(path, offset)]} ({where})" if (path, offset) in names else where
    return [line + (f" stack: {' < '.join(frame(*f) for f in frames)}" if frames else "") for line, frames in threads]


def ask_python_stacks(pids: Iterable[int], settle: float = 2.0) -> int:
    """SIGUSR1 to each of `pids` (processes that registered faulthandler on it print every thread's
    Python stack), then `settle` seconds for them to write; the number of processes asked."""
    asked = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
            asked += 1
        except OSError:
            continue
    if asked:
        time.sleep(settle)
    return asked
