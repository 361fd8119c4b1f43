"""Locust at a set arrival rate, with a latency SLO: the run fails when the SLO is missed.

    make serve                       # in one terminal
    make load-slo                    # Poisson arrivals at LOAD_RATE/s for LOAD_TIME, SLO from LOAD_SLO_*
    locust -f client/tools/load/slo_locustfile.py --headless -u 1 -t 60s --host http://localhost:8000 \\
        --arrivals poisson --arrival-rate 2 --slo-ttft-p99 2 --slo-itl-p99 0.2

Open loop: one arrival user (always one, whatever -u says) sends a request at each arrival, every
request on its own greenlet, without waiting for the ones in flight, so a slow server meets more
load, not less (closed-loop users that each wait for their answer would slow down with it).
Arrivals are `poisson` (exponential gaps, Locust's `poisson` wait time with a seeded generator) or
`constant` (one every 1/rate s). Requests are the seeded workload of the other Locust file
(INFLIGHT_WORKLOAD, INFLIGHT_MAX_TOKENS), streamed over Triton's gRPC stream (INFLIGHT_GRPC_URL,
else --host's host, port 8001) and timed per response as `inflight bench` times them.

Reported as Locust request events (type "grpc"): `time_to_first_token`, `inter_token_latency` (per
token) and `generate_stream`, plus `dropped` when --max-in-flight requests are already running. At
the end (after up to --drain-timeout s for the requests in flight), the exact p50/p99 of TTFT and
inter-token latency are printed, and the exit code is 1 when TTFT p99 > --slo-ttft-p99, inter-token
p99 > --slo-itl-p99 (seconds), or any request failed, was dropped or did not finish.
"""
from __future__ import annotations

import itertools
import os
import random
import sys
import time

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # grpc must yield to gevent, or one stream would block every greenlet

import gevent.pool  # noqa: E402
from locust import User, events, task  # noqa: E402

from client.tools.benchmarks.goodput import SLO  # noqa: E402
from client.tools.benchmarks.measure import Record, summarize  # noqa: E402
from client.tools.benchmarks.workloads import make_workload  # noqa: E402
from client.tools.load.locust_common import (close_grpc_client, fire_record, grpc_client,  # noqa: E402
                                             open_grpc_client, stream_record)

MAX_TOKENS = int(os.environ.get("INFLIGHT_MAX_TOKENS", "64"))
WORKLOAD = make_workload(os.environ.get("INFLIGHT_WORKLOAD", "mixed"), 256, seed=0, max_output_len=MAX_TOKENS)
RECORDS: list[Record] = []  # every request sent, finished or not


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--arrivals", choices=("poisson", "constant"), default="poisson",
                        env_var="INFLIGHT_ARRIVALS", help="arrival process (default poisson)")
    parser.add_argument("--arrival-rate", type=float, default=1.0, env_var="INFLIGHT_ARRIVAL_RATE",
                        help="requests per second (default 1)")
    parser.add_argument("--slo-ttft-p99", type=float, default=2.0, env_var="INFLIGHT_SLO_TTFT_P99",
                        help="time-to-first-token p99 bound, seconds (default 2)")
    parser.add_argument("--slo-itl-p99", type=float, default=0.2, env_var="INFLIGHT_SLO_ITL_P99",
                        help="inter-token latency p99 bound, seconds (default 0.2)")
    parser.add_argument("--max-in-flight", type=int, default=256, env_var="INFLIGHT_MAX_IN_FLIGHT",
                        help="arrivals beyond this many running requests are dropped (failures)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, env_var="INFLIGHT_DRAIN_TIMEOUT",
                        help="seconds the requests in flight at the end may take to finish (default 30)")
    parser.add_argument("--arrival-seed", type=int, default=0, env_var="INFLIGHT_ARRIVAL_SEED")


class ArrivalUser(User):
    """Sends one request per arrival, each on its own greenlet; never waits for an answer."""
    fixed_count = 1

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        if opts.arrival_rate <= 0:
            raise ValueError("--arrival-rate must be positive")
        self._rng = random.Random(opts.arrival_seed)
        self._items = itertools.cycle(WORKLOAD)
        self._pool = gevent.pool.Pool(opts.max_in_flight)
        self._idle: list[int] = []  # gRPC clients (one request at a time each) not in use

    def wait_time(self) -> float:
        opts = self.environment.parsed_options
        return self._rng.expovariate(opts.arrival_rate) if opts.arrivals == "poisson" else 1.0 / opts.arrival_rate

    @task
    def arrive(self) -> None:
        item = next(self._items)
        if self._pool.full():
            self.environment.events.request.fire(request_type="grpc", name="dropped", response_time=0,
                                                 response_length=0, context={},
                                                 exception=RuntimeError("--max-in-flight requests running"))
            RECORDS.append(Record(item, start=time.monotonic(), error="dropped"))
            return
        self._pool.spawn(self._one, item)

    def _one(self, item) -> None:
        key = self._idle.pop() if self._idle else open_grpc_client(self.host)
        index = len(RECORDS)  # greenlets switch only on I/O: nothing appends in between
        RECORDS.append(Record(item, start=time.monotonic(), error="unfinished at the end of the run"))
        try:
            rec = stream_record(grpc_client(key), item)
            RECORDS[index] = rec
            fire_record(self.environment, rec)
        finally:
            self._idle.append(key)

    def on_stop(self) -> None:
        self._pool.join(timeout=self.environment.parsed_options.drain_timeout)
        self._pool.kill()
        for key in self._idle:
            close_grpc_client(key)
        self._idle.clear()


def slo_report(records: list[Record], duration: float, slo: SLO) -> tuple[dict, list[str]]:
    """The run summed up as `inflight bench` sums a run up, and why it misses the SLO."""
    result = summarize(records, duration)
    misses = slo.misses(result) if records else ["no request was sent"]
    return result, misses


_started: list[float] = []


@events.test_start.add_listener
def _start(**_kw) -> None:
    _started.append(time.monotonic())


@events.quitting.add_listener
def _check_slo(environment, **_kw) -> None:
    opts = environment.parsed_options
    slo = SLO(opts.slo_ttft_p99, opts.slo_itl_p99)
    result, misses = slo_report(RECORDS, time.monotonic() - (_started[0] if _started else time.monotonic()), slo)
    ms = lambda v: "-" if v is None else f"{v * 1000:.1f} ms"  # noqa: E731
    print(f"SLO run: {opts.arrivals} arrivals at {opts.arrival_rate}/s, {result['num_requests']} requests, "
          f"{result['completed']} completed, {result['failed']} failed/dropped/unfinished\n"
          f"  TTFT p50 {ms(result['ttft_p50_s'])}, p99 {ms(result['ttft_p99_s'])} (SLO {ms(slo.ttft_p99_s)}); "
          f"inter-token p50 {ms(result['itl_p50_s'])}, p99 {ms(result['itl_p99_s'])} (SLO {ms(slo.itl_p99_s)})\n"
          f"  SLO {'missed: ' + '; '.join(misses) if misses else 'met'}", file=sys.stderr, flush=True)
    if misses:
        environment.process_exit_code = 1
