"""Free TCP ports for the servers a process starts (tritonserver's three, the OpenAI server's, a
peer's), each one this process has not handed out before.

A port is free when the OS binds it: the socket is closed again at once and the server binds it
later. Two ways that went wrong here: a port asked for while another one's socket was already
closed came back the same (the OS hands out a closed port again; a server once got one port for HTTP
and metrics), and a test that asked for its ports one call at a time got its gRPC port again for its
OpenAI server (a loaded `make test`, 2026-12-06: "port 50993 ... is not free for the OpenAI
server"). So `free_ports` keeps each socket bound until all are chosen, and passes over a port
it handed out in this process before (the last `REMEMBERED`), whatever the call.
"""
from __future__ import annotations

import socket
import threading
from collections import deque

REMEMBERED = 4096  # ports handed out in this process that are not handed out again
_given: deque[int] = deque(maxlen=REMEMBERED)
_lock = threading.Lock()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` ports free now, all different, none handed out by this process before."""
    socks: list[socket.socket] = []
    chosen: list[int] = []
    try:
        with _lock:
            while len(chosen) < count:
                if len(socks) > count + 256:
                    raise OSError(f"no {count} free ports on {host} that this process has not handed out")
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)  # bound until the end: the OS does not give it again meanwhile
                s.bind((host, 0))
                port = s.getsockname()[1]
                if port not in _given:
                    chosen.append(port)
            _given.extend(chosen)
        return chosen
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
