"""Issue 46, causes 2, 3 and 13: the KV-event ports and their config against hostile input.

- cause 13: every edge of kv_events_config is one line naming the key (100k-deep JSON, 2**70 in any
  number, a lone surrogate in the topic, a rank that moves a port past 65535), and a publisher that
  stops anyway says so (an ERROR line, inflight_kv_events_publisher_failures_total) and queues
  nothing more;
- cause 2: a flood of replay requests (another process, as fast as it can: malformed ones, and
  valid ones that each ask for the whole buffer of 2,000 batches again) neither delays events by
  more than one round of replay work (it held them 10 s), nor grows the log by more than a few
  lines (limit 1 MB; it was 71 MB in 8 s), nor the RSS by 50 MB;
- cause 3: a 1 GiB frame announced to either port (a raw ZMTP 3.0 peer, no pyzmq, nothing
  allocated here) is refused after its 9-byte header: the peer is cut off, the RSS does not grow;
- a `*` address binds the server's host (`bind_host`, which `inflight serve --host` sets).
The publisher runs alone (no engine): batches go in through its collector, as the engine's step
hands them over; the subscriber and the flooders are real ZMQ peers over loopback TCP."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import pytest
import zmq

from backend.core.config import EngineConfig
from backend.core.kv_events_config import KVEventsConfig, parse_kv_events_config
from backend.kv.event_publisher import REPLAY_FRAMES_PER_ROUND, KVEventPublisher
from serving.triton_launcher import free_port

TOPIC = b"kv@test"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("raw, words", [
    ("[" * 100_000 + "]" * 100_000, "kv_events_config is nested too deeply"),
    ('{"enable_kv_cache_events": true, "buffer_steps": %d}' % 2 ** 70, "buffer_steps must be >= 1 and <= 1000000"),
    ('{"enable_kv_cache_events": true, "hwm": %d}' % 2 ** 70, "hwm must be >= 0 and <= 10000000"),
    ('{"enable_kv_cache_events": true, "max_queue_size": %d}' % 2 ** 70, "max_queue_size must be >= 1"),
    ('{"enable_kv_cache_events": true, "topic": "\\ud800"}', "kv_events_config.topic is not valid Unicode"),
    ('{"enable_kv_cache_events": true, "data_parallel_rank": %d}' % 2 ** 70, "data_parallel_rank must be >= 0"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:65535", "data_parallel_rank": 1}',
     "endpoint's port 65535 + data_parallel_rank 1 must be in [1, 65535]"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:x"}', "replay_endpoint must be tcp://HOST:PORT"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 1e400}', "buffer_steps has the wrong type"),
    ('{"enable_kv_cache_events": true, "topic": "%s"}' % ("t" * 5000), "topic is 5000 characters; the limit is 1024"),
    ('{"enable_kv_cache_events": true, "bind_host": "a b"}', "bind_host must be an address or a host name"),
])
def test_each_edge_of_the_config_is_one_line_naming_the_key(raw, words):
    with pytest.raises(ValueError) as err:
        EngineConfig(kv_events_config=raw, enable_kv_cache_reuse=True)
    message = str(err.value)
    assert words in message and "\n" not in message and len(message) < 400, message
    message.encode("utf-8")  # a refusal that itself holds a lone surrogate could not be logged


def make_publisher(**config) -> tuple[KVEventPublisher, int, int]:
    pub_port, replay_port = free_port(), free_port()
    raw = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub_port}", "replay_endpoint": f"tcp://*:{replay_port}",
           "topic": TOPIC.decode(), "bind_host": "127.0.0.1", **config}
    return KVEventPublisher(parse_kv_events_config(json.dumps(raw)), 8, 16, "CPU"), pub_port, replay_port


def subscribe(context, port: int):
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    return sub


def latencies(publisher: KVEventPublisher, sub, count: int, gap_s: float = 0.01,
              work: "ReplayWork | None" = None) -> list[float]:
    """Hand `count` batches to the publisher as the engine does, `gap_s` apart; the seconds each
    took to reach the subscriber (and, with `work`, the replay work done before each went out)."""
    out = []
    for i in range(count):
        if work is not None:
            work.submitted()
        sent = time.monotonic()
        publisher.collector.submit(time.time(), [("cleared",)])
        assert sub.poll(5000), f"batch {i} never arrived"
        sub.recv_multipart()
        out.append(time.monotonic() - sent)
        time.sleep(gap_s)
    return out


class ReplayWork:
    """Counts the replay socket's units of work (a frame of an answer sent, a malformed request read:
    what REPLAY_FRAMES_PER_ROUND budgets) and, for each batch, how many were done between its
    submission (read on the caller's thread) and its publishing (on the publisher's). A count,
    not a time: it says whether replay went before a batch whatever else ran on the machine."""

    def __init__(self, publisher: KVEventPublisher):
        self.replay = publisher._replay
        self.sent = 0
        self.before: list[int] = []  # per batch: units done between submit and publish
        self._at_submit = 0
        sock = self.replay.sock
        work = self

        class Counting:
            def __getattr__(self, name):
                return getattr(sock, name)

            def send_multipart(self, frames, *args, **kwargs):
                work.sent += 1
                return sock.send_multipart(frames, *args, **kwargs)

        publish = publisher._publish
        self.replay.sock = Counting()
        self._at_submit = self._units()
        publisher._publish = lambda *args: (self.before.append(self._units() - self._at_submit), publish(*args))

    def _units(self) -> int:
        return self.sent + self.replay.num_bad

    def submitted(self) -> None:
        self._at_submit = self._units()


def join(publisher, sub) -> None:
    """ZMQ drops what a SUB gets before its subscription reaches the publisher: probe until heard."""
    for _ in range(100):
        publisher.collector.submit(time.time(), [("cleared",)])
        if sub.poll(100):
            while sub.poll(50):
                sub.recv_multipart()
            return
    raise AssertionError("the subscriber never heard the publisher")


def thread_cpu_s(tid: int) -> float:
    """CPU seconds thread `tid` of this process has used (the served-gap tool's reading of a thread)."""
    import psutil

    from client.tools.benchmarks.served_gap import thread_cpu_seconds
    return thread_cpu_seconds(os.getpid(), next(t for t in psutil.Process().threads() if t.id == tid))


class LogBytes(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.bytes = self.lines = 0

    def emit(self, record):
        self.bytes += len(self.format(record).encode("utf-8", "replace")) + 1
        self.lines += 1


BUFFERED = 2000
FLOOD = """
import sys, time, zmq
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(4)]
for s in socks:
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(sys.argv[1])
end, n = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    for s in socks:
        s.send_multipart((b"bad", b"x" * 9, b"y"), copy=True)   # frames a replay request never has
        s.send(b"")                                              # an empty request
        s.send_multipart((b"", bytes(8)))                        # a valid one: the whole buffer again
    n += 3 * len(socks)
print(n)
"""


@pytest.mark.slow
def test_a_replay_flood_neither_delays_events_nor_floods_the_log(frozen_heap):
    publisher, pub_port, replay_port = make_publisher(buffer_steps=BUFFERED)
    context = zmq.Context()
    handler = LogBytes()
    logging.getLogger("backend.kv.event_publisher").addHandler(handler)
    try:
        sub = subscribe(context, pub_port)
        join(publisher, sub)
        for _ in range(BUFFERED):  # a full replay buffer: each valid request is answered with all of it
            publisher.collector.submit(time.time(), [("cleared",)])
        while publisher._queue.qsize():
            time.sleep(0.01)
        while sub.poll(100):
            sub.recv_multipart()
        quiet = latencies(publisher, sub, 50)
        rss = rss_bytes()
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, f"tcp://127.0.0.1:{replay_port}", "3"],
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the flood is on
        cpu, wall = thread_cpu_s(publisher._thread.native_id), time.monotonic()
        work = ReplayWork(publisher)
        flooded = latencies(publisher, sub, 150, work=work)
        share = (thread_cpu_s(publisher._thread.native_id) - cpu) / (time.monotonic() - wall)
        sent = int(flood.communicate(timeout=60)[0])
        grew = rss_bytes() - rss
    finally:
        logging.getLogger("backend.kv.event_publisher").removeHandler(handler)
        publisher.close()
        context.destroy(linger=0)
    bad = publisher.figures()["kv_events_bad_requests"]
    print(f"flood: {sent} requests sent, {bad} read, {work.sent} answer frames sent; event latency max "
          f"{max(quiet) * 1e3:.1f} ms quiet, {max(flooded) * 1e3:.1f} ms flooded (median {median(flooded) * 1e3:.1f}); "
          f"replay work before a batch at most {max(work.before)} units; log {handler.bytes} bytes in {handler.lines} "
          f"lines; RSS +{grew >> 20} MiB; the publisher's thread busy {share:.0%} of the flood")
    assert sent > 10_000 and bad >= 5, (sent, bad)  # a flood, and read (most of the time goes to valid ones, in REPLAY_SHARE)
    # answered as fast as it came, the flood kept the thread busy all the time and the engine's thread
    # waiting for the GIL: SmolLM2's decode at 0.53-0.62x beside it (0.92-1.11x beside a busy loop)
    assert share < 0.4, f"the publisher's thread was busy {share:.0%} of the flood (REPLAY_SHARE)"
    # publishing first: at most the rest of one round of replay work between a batch's submission and its
    # sending (a flood answered whole held events 10 s). Counted, not timed: in one CI run a single event of
    # 150 took 209 ms while the publisher's thread was busy 7% of the flood, the process waiting for a CPU
    # (a loaded 2-core machine), which no code here controls; the time is checked on the median, which one
    # such stall does not move.
    assert len(work.before) == len(flooded) and work.sent > 0, (len(work.before), work.sent)
    assert max(work.before) <= REPLAY_FRAMES_PER_ROUND, sorted(work.before)[-5:]
    assert median(flooded) < max(quiet) + 0.05, (max(quiet), median(flooded))
    assert handler.bytes < 1 << 20 and handler.lines <= 3, (handler.bytes, handler.lines)
    assert grew < 50 << 20, grew


def zmtp_peer(port: int, socket_type: bytes) -> socket.socket:
    """A raw ZMTP 3.0 peer past its handshake (NULL mechanism), as any client may write one."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31)
    greeting = b""
    while len(greeting) < 64:
        greeting += sock.recv(64 - len(greeting))
    prop = b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    body = b"\x05READY" + prop
    sock.sendall(b"\x04" + bytes([len(body)]) + body)
    return sock


def send_huge_frame(port: int, socket_type: bytes, size: int = 1 << 30) -> int:
    """Announce one frame of `size` bytes and send its body; returns the bytes sent before the peer
    was cut off (all of them if it never is)."""
    sock = zmtp_peer(port, socket_type)
    chunk, sent = b"\x00" * (1 << 20), 0
    try:
        sock.sendall(b"\x02" + size.to_bytes(8, "big"))  # a long, last frame
        while sent < size:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:  # reset: the publisher dropped the connection
        pass
    finally:
        sock.close()
    return sent


@pytest.mark.slow
def test_a_1_gib_frame_to_either_port_is_refused_unread():
    publisher, pub_port, replay_port = make_publisher()
    context = zmq.Context()
    try:
        sub = subscribe(context, pub_port)
        join(publisher, sub)
        rss = rss_bytes()
        sent = {name: send_huge_frame(port, kind) for name, port, kind in
                (("replay", replay_port, b"DEALER"), ("pub", pub_port, b"SUB"))}
        grew = rss_bytes() - rss
        after = latencies(publisher, sub, 10)  # still publishing
    finally:
        publisher.close()
        context.destroy(linger=0)
    print(f"1 GiB frame: sent before the cut {sent}; RSS +{grew >> 20} MiB; latency after max {max(after) * 1e3:.1f} ms")
    assert all(n < 256 << 20 for n in sent.values()), sent
    assert grew < 50 << 20, grew
    assert max(after) < 0.5


def test_a_publisher_that_stops_says_so_and_queues_nothing_more(caplog):
    """The loop cannot survive its buffer gone (a fault put in on purpose): the thread ends, one
    ERROR line says so, the failure is counted, and later batches are counted as dropped."""
    publisher, pub_port, replay_port = make_publisher()
    context = zmq.Context()
    try:
        publisher._buffer = None  # the fault
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        with caplog.at_level(logging.ERROR, logger="backend.kv.event_publisher"):
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            publisher._thread.join(5)
        assert not publisher._thread.is_alive()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].startswith("KV events: the publisher stopped (TypeError: "), errors
        for _ in range(3):
            publisher.collector.submit(time.time(), [("cleared",)])
        assert publisher.figures() == {"kv_events_dropped": 3, "kv_events_publisher_failures": 1,
                                       "kv_events_bad_requests": 0}
        assert publisher._queue.qsize() == 0
    finally:
        publisher.close()
        context.destroy(linger=0)


def test_a_star_address_binds_the_servers_host_only():
    from backend.kv.event_sockets import bind_address

    assert bind_address("tcp://*:5557", "127.0.0.1") == "tcp://127.0.0.1:5557"
    assert bind_address("tcp://*:5557", "0.0.0.0") == bind_address("tcp://*:5557", "") == "tcp://*:5557"
    assert bind_address("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    assert bind_address("ipc:///tmp/kv", "127.0.0.1") == "ipc:///tmp/kv"
    publisher, pub_port, replay_port = make_publisher()
    try:
        with open("/proc/net/tcp") as f:
            listening = {line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"}
        for port in (pub_port, replay_port):
            assert f"0100007F:{port:04X}" in listening and f"00000000:{port:04X}" not in listening, port
    finally:
        publisher.close()
    assert KVEventsConfig().bind_host == ""  # the Python API's default: every interface, as vLLM


def test_the_servers_host_reaches_the_publisher(monkeypatch, tmp_path):
    """`inflight serve --host H` runs tritonserver with INFLIGHT_HOST=H (serving/triton_launcher.py);
    each model instance's kv_events_config then binds H, unless the config names its own."""
    from adapter_module import load_adapter
    from backend.core.kv_events_config import HOST_ENV

    engine_config = load_adapter().engine_config
    raw = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5559"}
    params = {"model_path": str(tmp_path), "enable_kv_cache_reuse": "true", "kv_events_config": json.dumps(raw)}
    monkeypatch.setenv(HOST_ENV, "127.0.0.1")
    first, second = (engine_config(params, "CPU", "0", tmp_path, f"llm_0_{i}").kv_events for i in (0, 1))
    assert (first.bind_host, second.bind_host, second.data_parallel_rank) == ("127.0.0.1", "127.0.0.1", 1)
    own = {**params, "kv_events_config": json.dumps({**raw, "bind_host": "10.0.0.7"})}
    assert engine_config(own, "CPU", "0", tmp_path, "llm_0_0").kv_events.bind_host == "10.0.0.7"
    monkeypatch.delenv(HOST_ENV)
    assert engine_config(params, "CPU", "0", tmp_path, "llm_0_0").kv_events.bind_host == ""


def test_the_gateway_pods_bind_the_events_ports_on_their_address_and_admit_only_the_picker():
    import yaml

    from backend.kv.event_sockets import bind_address

    path = Path(__file__).resolve().parents[1] / "deploy/kubernetes/gateway/model-servers.yaml"
    docs = list(yaml.safe_load_all(path.read_text()))
    (pool,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in pool["spec"]["template"]["spec"]["containers"][0]["env"]}
    events = parse_kv_events_config(env["INFLIGHT_KV_EVENTS_CONFIG"].replace("$(POD_IP)", "10.1.2.3"))
    assert [bind_address(e, events.bind_host) for e in (events.endpoint, events.replay_endpoint)] == \
        ["tcp://10.1.2.3:5557", "tcp://10.1.2.3:5559"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pool["spec"]["template"]["metadata"]["labels"].items()
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ports & {5557, 5559}:
            assert ports == {5557, 5559} and rule["from"] == [
                {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "inflight-epp"}}}], rule


def test_replay_gets_its_burst_at_full_speed_then_its_share_of_the_thread():
    """ReplayBudget on a made clock: a whole-buffer answer (~50 ms of work) fits in the burst with no
    wait; a flood answered round after round gets REPLAY_SHARE of the time once the burst is spent."""
    from backend.kv.event_publisher import REPLAY_BURST_S, REPLAY_SHARE, ReplayBudget

    budget = ReplayBudget(0.0)
    now, waited = 0.0, 0.0
    for _ in range(200):  # 200 rounds of 0.25 ms: one 2,000-batch answer
        budget.refill(now)
        assert budget.wait_s() == 0.0
        budget.credit -= 0.00025
        now += 0.00025
    busy = 0.0
    while now < 20.0:  # a flood: a round whenever there is credit
        budget.refill(now)
        pause = budget.wait_s()
        if pause:
            now += pause
            waited += pause
            continue
        budget.credit -= 0.0003
        busy += 0.0003
        now += 0.0003
    assert waited > 0
    assert busy <= REPLAY_SHARE * now + REPLAY_BURST_S + 0.001, (busy, now)
    assert busy >= REPLAY_SHARE * now * 0.9, "the share is a cap, not a stop"
    assert busy / now < 0.2, f"a flood kept replay busy {busy / now:.0%} of the time"
