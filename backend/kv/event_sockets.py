"""The KV-event publisher's ZMQ sockets (backend/kv/event_publisher.py runs them on its thread): the
addresses they bind or connect to, the size limits on what a peer may send them, and the replay
socket's answers. Every socket reachable from the network is sized for what a subscriber or the
llm-d indexer sends, and nothing more (issue 46; docs/security.md, "KV-events ports"):

- ZMQ_MAXMSGSIZE on every socket: the PUB socket's inbound messages are subscriptions (a topic
  prefix, `MAX_SUBSCRIPTION_BYTES`), the replay socket's a request of an empty frame and an 8-byte
  sequence (`MAX_REQUEST_BYTES`). ZMQ reads a frame's length before its body and drops the
  connection of a peer that announces more, so a 1 GiB frame is never allocated.
- The replay socket's receive queue is short (`REPLAY_RCVHWM` requests per peer), a request with
  more frames than three has the rest discarded as they are read, and a malformed one is counted
  and logged at most once per `LOG_INTERVAL_S`.
- A `*` address binds the server's host (`bind_host`: `inflight serve --host`), not every
  interface; "" or 0.0.0.0 keeps vLLM's every-interface bind.
"""
from __future__ import annotations

import logging
from typing import Optional

from backend.core.kv_events_config import KVEventsConfig
from backend.core.log_limit import LimitedLog

log = logging.getLogger("backend.kv.event_publisher")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_SUBSCRIPTION_BYTES = 4096
MAX_REQUEST_BYTES = 64
REPLAY_RCVHWM = 64
LOG_INTERVAL_S = 10.0
ALL_INTERFACES = ("", "0.0.0.0", "*", "::")


def rank_endpoint(endpoint: Optional[str], rank: int) -> Optional[str]:
    """The address of data-parallel rank `rank` (vLLM's offset_endpoint_port)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: an address with `*`, `::`, ipc:// or inproc:// is bound, any other connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_address(endpoint: str, host: str) -> str:
    """A `tcp://*:PORT` address bound on `host` instead of every interface."""
    if host in ALL_INTERFACES or not endpoint.startswith("tcp://*:"):
        return endpoint
    return f"tcp://{f'[{host}]' if ':' in host else host}:{endpoint.rpartition(':')[2]}"


def open_sockets(config: KVEventsConfig, endpoint: str, replay_endpoint: Optional[str]):
    """(context, PUB socket, ROUTER socket or None), bound or connected, with their limits."""
    import zmq

    context = zmq.Context()
    sockets = []
    try:
        pub = context.socket(zmq.PUB)
        sockets.append(pub)
        pub.set_hwm(config.hwm)
        _limit(pub, MAX_SUBSCRIPTION_BYTES)
        if binds(endpoint):
            _bind(pub, bind_address(endpoint, config.bind_host))
        else:
            pub.connect(endpoint)
        replay = None
        if replay_endpoint:
            replay = context.socket(zmq.ROUTER)
            sockets.append(replay)
            replay.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
            _limit(replay, MAX_REQUEST_BYTES)
            _bind(replay, bind_address(replay_endpoint, config.bind_host))
    except BaseException:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
        raise
    return context, pub, replay


def _limit(sock, max_bytes: int) -> None:
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.LINGER, 0)


def _bind(sock, address: str) -> None:
    import zmq

    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(address)


class ReplayServer:
    """Answers replay requests from the publisher's buffer of (seq, payload): [identity, empty, 8-byte
    start] gets [identity, empty, topic, seq, payload] per buffered batch from `start` on, then the
    end marker [identity, empty, empty, -1, empty] (vLLM's current replay frames). An answer goes
    out a few frames at a time (`serve`'s budget), between the publisher's rounds of batches, so a
    request for a long buffer never holds publishing."""

    def __init__(self, sock, topic: bytes):
        self.sock = sock
        self.topic = topic
        self.num_bad = 0  # malformed requests ignored (inflight_kv_events_bad_requests_total)
        self._log = LimitedLog(log, LOG_INTERVAL_S)
        self._answer: Optional[tuple[bytes, list]] = None  # (client, the batches still to send)

    def busy(self) -> bool:
        return self._answer is not None or self.sock.poll(0) != 0

    def serve(self, buffer, budget: int) -> None:
        """Send up to `budget` frames of answers, reading requests as the answers before them end (a
        malformed request costs one frame of the budget)."""
        while budget > 0:
            if self._answer is None:
                if self.sock.poll(0) == 0:
                    return
                self._answer = self._request(buffer)
                budget -= self._answer is None
                continue
            client, batches = self._answer
            if not batches:
                self.sock.send_multipart((client, b"", b"", END_SEQ, b""))
                self._answer = None
            else:
                seq, payload = batches.pop()
                self.sock.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            budget -= 1

    def _request(self, buffer) -> Optional[tuple[bytes, list]]:
        frames, count = self._receive()
        if count != 3 or len(frames[1]) != 0 or len(frames[2]) != 8:
            self.num_bad += 1
            self._log.warning("KV events: a replay request of %d frame(s) was ignored (want: an empty frame and an "
                              "8-byte start sequence); %d ignored so far", max(0, count - 1), self.num_bad)
            return None
        client, _, start = frames
        first = int.from_bytes(start, "big")
        return client, [item for item in reversed(buffer) if item[0] >= first]  # popped from the end: oldest first

    def _receive(self) -> tuple[list[bytes], int]:
        """The first three frames of the next message and how many it had (the rest read and dropped)."""
        import zmq

        frames, count, more = [], 0, True
        while more:
            frame = self.sock.recv()
            count += 1
            if count <= 3:
                frames.append(frame)
            more = self.sock.getsockopt(zmq.RCVMORE)
        return frames, count
