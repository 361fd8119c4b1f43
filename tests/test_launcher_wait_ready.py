"""`TritonServer.wait_ready` returns only once every endpoint listens.

tritonserver starts its metrics service after its HTTP service (41 ms later on a quiet 2-core
machine, more on a loaded one); a launcher that returned on the model's ready alone let a CI run's
first metrics scrape after a restart find the port closed (tests/e2e/test_kv_tiers_served.py).
Here the "server" is a model that reports ready at once and a metrics socket that only starts
listening later: wait_ready must wait for it. And the three ports it picks are three.
"""
import os
import socket
import threading
import time

from serving.triton_launcher import TritonServer, free_port


class _Running:
    pid = os.getpid()  # a process with no stubs, waiting on none

    def poll(self):
        return None


def test_wait_ready_waits_for_the_metrics_port_after_the_model_is_ready(monkeypatch):
    server = TritonServer(metrics_port=free_port())
    server.process = _Running()
    monkeypatch.setattr(server, "is_ready", lambda: True)
    listening = threading.Event()
    sock = socket.socket()

    def listen_later():
        time.sleep(0.6)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.metrics_port))
        sock.listen()
        listening.set()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        server.wait_ready(timeout=10)
        assert listening.is_set()
        socket.create_connection(("127.0.0.1", server.metrics_port), timeout=2).close()
    finally:
        thread.join()
        sock.close()
        server.process = None


class _ReusingOS:
    """socket.socket as an OS that hands out the lowest port no open socket holds (Linux may hand
    a port out again once its socket is closed)."""
    held: set = set()

    def __init__(self, *args):
        self.port = None

    def bind(self, address):
        self.port = min(p for p in range(40000, 40010) if p not in _ReusingOS.held)
        _ReusingOS.held.add(self.port)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self):
        _ReusingOS.held.discard(self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_a_server_gets_three_different_ports_even_where_the_os_reuses_a_closed_one(monkeypatch):
    """HTTP, gRPC and metrics each chosen with its socket closed before the next was bound once got
    the same port twice (tritonserver: 'failed to start HTTP service: Socket ... already in use')."""
    monkeypatch.setattr(socket, "socket", _ReusingOS)
    server = TritonServer()
    assert len({server.http_port, server.grpc_port, server.metrics_port}) == 3
