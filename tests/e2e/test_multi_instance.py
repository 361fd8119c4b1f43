"""Two engine instances in one server (`inflight config --cpu --count 2`, what one engine per GPU
looks like): requests land on both, every inflight_* series carries its instance and device, and
the per-instance gauges sum to the true running count and the KV blocks of both engines, while the
counters and histograms add up to what the requests did."""
import threading
import time
from collections import defaultdict

import pytest

from templates.exposition import read_page

from .conftest import SERVER_PARAMS, cpu_repository, requires_tritonserver, wait_until

pytestmark = requires_tritonserver

REQUESTS = 8
MAX_TOKENS = 1920    # all eight must be seen running at once (gauges refresh every 0.1 s): 480 lasted ~1 s on a
                     # quiet machine once steps got faster, less than eight connections took to open on a busy one;
                     # 960 was outrun under load (two busy processes on the two cores: Triton handed the eight to the
                     # instances over seconds, and the first finished before the last started)
KV_TOKENS = 16384     # per engine: all eight fit in one (8 x 1932 tokens); small, so the test is quick to start
BLOCK_SIZE = 16
def scrape(server) -> list[tuple[str, dict, float]]:
    """Every inflight_* series: (name, labels, value)."""
    return [(s.name, s.labels, s.value) for s in read_page(server.metrics_url, timeout=10) if s.name.startswith("inflight_")]


def per_instance(series, name: str, **match) -> dict[str, float]:
    values: dict[str, float] = defaultdict(float)
    for n, labels, value in series:
        if n == name and all(labels.get(k) == v for k, v in match.items()):
            values[labels.get("instance", "(none)")] += value
    return dict(values)


@pytest.fixture(scope="module")
def two_instance_server(tmp_path_factory, model_path):
    from serving.triton_launcher import TritonServer

    repo = tmp_path_factory.mktemp("two_instances")
    cpu_repository(repo, count=2)
    params = {**SERVER_PARAMS, "cpu_kv_cache_tokens": str(KV_TOKENS), "kv_block_size": str(BLOCK_SIZE),
              "max_model_len": str(MAX_TOKENS + 64)}
    with TritonServer(repo, params=params, model_path=str(model_path)) as server:
        yield server


def test_per_instance_metrics_sum_to_the_server_totals(two_instance_server):
    from client.grpc_client import GrpcClient

    server = two_instance_server
    prompts = [[3 + i] * (5 + i) for i in range(REQUESTS)]        # lengths 5..12: known prompt tokens
    results: list = [None] * REQUESTS
    errors: list = []

    # Every client connected first, then all eight sent at once: on a loaded machine setting up a
    # connection took longer than a request runs, and the requests ran one or two at a time.
    clients = [GrpcClient(server.grpc_url) for _ in range(REQUESTS)]
    assert all(c.is_ready() for c in clients)
    start = threading.Barrier(REQUESTS)

    def send(i):
        try:
            with clients[i] as client:
                start.wait(timeout=60)
                results[i] = client.generate(prompts[i], stream=True, max_tokens=MAX_TOKENS, ignore_eos=True,
                                             temperature=0.0)
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(REQUESTS)]
    for t in threads:
        t.start()
    try:
        # All eight admitted at once (plenty of KV, max_num_seqs 64): the running gauges of the two
        # instances must then sum to eight, with some on each engine.
        seen = []  # what the gauges said, for the message of a failure

        def all_running():
            r = per_instance(scrape(server), "inflight_num_requests_running")
            if not seen or seen[-1] != r:
                seen.append(r)
            return r if sum(r.values()) == REQUESTS else None
        try:
            running = wait_until(all_running, timeout=60, interval=0.02)
        except AssertionError:
            raise AssertionError(f"never all {REQUESTS} running at once; the gauges said, in turn: {seen[-40:]}; "
                                 f"done: {sum(r is not None for r in results)}; errors: {errors[:2]}") from None
    finally:
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert len(running) == 2 and all(v > 0 for v in running.values()), running

    series = scrape(server)
    instances = {labels["instance"] for _, labels, _ in series}
    assert len(instances) == 2, instances
    for name, labels, _ in series:
        assert labels.get("device") == "cpu" and labels.get("instance") in instances, (name, labels)
    total_blocks = per_instance(series, "inflight_kv_blocks", state="total")
    assert total_blocks == {i: KV_TOKENS // BLOCK_SIZE for i in instances}   # each engine's own cache
    assert sum(total_blocks.values()) == 2 * KV_TOKENS // BLOCK_SIZE

    # Counters and histograms: each request is counted once, by the engine that ran it.
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)

    def settled(series):
        done = sum(per_instance(series, "inflight_e2e_request_latency_seconds_count").values()) == REQUESTS
        return done and sum(per_instance(series, "inflight_num_requests_running").values()) == 0
    deadline = time.monotonic() + 30
    while not settled(series := scrape(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled(series), "\n".join(f"{n} {l.get('instance')} {v}" for n, l, v in series if "_bucket" not in n)
    assert sum(per_instance(series, "inflight_prompt_tokens_total").values()) == sum(map(len, prompts))
    assert sum(per_instance(series, "inflight_generation_tokens_total").values()) == REQUESTS * MAX_TOKENS
    assert sum(per_instance(series, "inflight_time_to_first_token_seconds_count").values()) == REQUESTS
    assert sum(per_instance(series, "inflight_kv_blocks", state="used").values()) == 0
