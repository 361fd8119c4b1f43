"""Issue 46, cause 2, on the real tritonserver: the KV-event ports of a served engine follow the
server's --host. TritonServer (what `inflight serve` runs) passes its host to the model as
INFLIGHT_HOST; a `*` endpoint then binds 127.0.0.1, not every interface, and a subscriber on
loopback still hears the events of a request, and the replay port answers."""
from __future__ import annotations

import itertools
import json

import zmq

from serving.triton_launcher import TritonServer, free_port

from .conftest import requires_tritonserver, wait_until
from .raw_requests import http_generate

pytestmark = requires_tritonserver


def listening() -> set[str]:
    """The local addresses with a listening TCP socket, as /proc/net/tcp writes them (hex ip:port)."""
    with open("/proc/net/tcp") as f:
        return {line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"}


def test_the_events_ports_follow_host_and_carry_a_requests_blocks(model_repository, model_path):
    pub, replay = free_port(), free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": "kv@test"}
    params = {"enable_kv_cache_reuse": "true", "kv_events_config": json.dumps(events)}
    context = zmq.Context()
    try:
        with TritonServer(model_repository, params=params, model_path=str(model_path), host="127.0.0.1") as server:
            bound = listening()
            for port in (pub, replay):
                assert f"0100007F:{port:04X}" in bound and f"00000000:{port:04X}" not in bound, (port, sorted(bound))
            sub = context.socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{pub}")
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
            heard, tries = [], itertools.count()

            def hear() -> bool:
                # A new prompt each try: a subscriber that joined after a request's blocks were published
                # (zmq drops what it sends before the connection is up, slow on a loaded host) would never
                # hear the same prompt again, its blocks then being the prefix cache's hits, not new ones.
                http_generate(server.http_url, {"text_input": f"try {next(tries)}: " +
                                                "a prompt long enough to fill a block or two " * 4,
                                                "max_tokens": 2}, stream=False)
                while sub.poll(200):
                    heard.append(sub.recv_multipart())
                return bool(heard)

            wait_until(hear, timeout=30, interval=0.1)
            assert heard[0][0] == b"kv@test"
            dealer = context.socket(zmq.DEALER)
            dealer.connect(f"tcp://127.0.0.1:{replay}")
            dealer.send_multipart((b"", bytes(8)))
            assert dealer.poll(10_000), "no replay answer"
            assert dealer.recv_multipart()[1] == b"kv@test"
    finally:
        context.destroy(linger=0)
