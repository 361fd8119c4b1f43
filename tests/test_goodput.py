"""The goodput search of `inflight bench --goodput` (client/tools/benchmarks/goodput.py) against a
synthetic server: a function rate -> the p99 latencies a queue with that capacity would show. The
served run is tests/e2e/test_goodput_served.py."""
import pytest

from client.tools.benchmarks import bench
from client.tools.benchmarks.goodput import SLO, find_goodput, instances_needed


def synthetic_server(capacity: float, ttft: float = 0.1, itl: float = 0.02):
    """An M/M/1-like server: latencies grow as 1 / (1 - load) and never end past its capacity."""
    measured = []

    def measure(rate: float) -> dict:
        measured.append(rate)
        load = rate / capacity
        if load >= 1:
            return {"num_requests": 10, "failed": 0, "ttft_p99_s": 1e9, "itl_p99_s": 1e9}
        return {"num_requests": 10, "failed": 0, "ttft_p99_s": ttft / (1 - load), "itl_p99_s": itl / (1 - load)}
    return measure, measured


# The SLO TTFT p99 <= 0.5 s meets rates up to capacity * 0.8 (0.1 / (1 - 0.8)); ITL 0.1 s: the same.
# (Capacities of 10.5 keep that threshold off the rates the search tries.)
SLO_ = SLO(ttft_p99_s=0.5, itl_p99_s=0.1)


@pytest.mark.parametrize("start", [0.3, 1.0, 7.0, 40.0, 500.0])
def test_the_search_brackets_from_below_or_above_then_bisects_to_the_threshold(start):
    measure, measured = synthetic_server(capacity=10.5)
    search = find_goodput(measure, SLO_, start=start, max_runs=20, tolerance=0.02)
    true = 8.4
    assert search.best is not None and search.best <= true + 1e-9
    assert search.best >= true * 0.97  # within the tolerance (and one bisection step) below it
    assert search.lowest_miss > true - 1e-9 and search.lowest_miss - search.best <= 0.02 * search.best
    assert [r["rate"] for r in search.runs] == measured
    assert all(r["meets_slo"] == (r["rate"] <= true + 1e-9) for r in search.runs)


def test_the_search_stops_at_max_runs_with_the_best_so_far():
    measure, measured = synthetic_server(capacity=10.5)  # meets the SLO up to 8.4/s
    search = find_goodput(measure, SLO_, start=1.0, max_runs=6, tolerance=1e-6)
    assert measured == [1.0, 2.0, 4.0, 8.0, 16.0, 12.0]
    assert search.best == 8.0 and search.lowest_miss == 12.0


def test_a_failed_request_or_a_missing_latency_misses_the_slo():
    ok = {"failed": 0, "ttft_p99_s": 0.1, "itl_p99_s": 0.01}
    assert SLO_.misses(ok) == []
    assert SLO_.misses({**ok, "failed": 1}) == ["1 failed"]
    assert SLO_.misses({**ok, "itl_p99_s": None}) == ["no ITL p99 measured"]
    assert SLO_.misses({**ok, "ttft_p99_s": 0.6}) == ["TTFT p99 600 > 500 ms"]
    assert SLO_.misses({**ok, "itl_p99_s": 0.2}) == ["ITL p99 200 > 100 ms"]


def test_when_no_rate_meets_the_slo_the_search_halves_down_to_the_minimum():
    measure, measured = synthetic_server(capacity=10.0, ttft=5.0)  # TTFT 5 s even when idle
    search = find_goodput(measure, SLO_, start=4.0, max_runs=10, min_rate=0.5)
    assert search.best is None and search.goodput_rps == 0.0
    assert measured == [4.0, 2.0, 1.0, 0.5]


def test_a_server_that_meets_the_slo_at_the_highest_rate_allowed_stops_there():
    measure, measured = synthetic_server(capacity=1e9)
    search = find_goodput(measure, SLO_, start=1.0, max_runs=20, max_rate=10.0)
    assert measured == [1.0, 2.0, 4.0, 8.0, 10.0] and search.best == 10.0 and search.lowest_miss is None


def test_instances_needed_is_the_ceiling_of_target_over_goodput():
    # the seed article: 2,000 requests a minute
    assert instances_needed(2000, 2000 / 60 / 2) == 2
    assert instances_needed(2000, 2000 / 60 / 2 - 0.01) == 3
    assert instances_needed(2000, 4.5) == 8   # 270/min each: 7.4 -> 8
    assert instances_needed(2000, 100.0) == 1
    assert instances_needed(2000, 0.0) is None


def test_bad_search_bounds_are_refused():
    measure, _ = synthetic_server(10.0)
    with pytest.raises(ValueError):
        find_goodput(measure, SLO_, start=0.01, min_rate=0.1)
    with pytest.raises(ValueError):
        find_goodput(measure, SLO_, start=1.0, max_runs=0)


def test_inflight_bench_lists_goodput_and_goodput_has_its_own_options(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0 and "--goodput" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        bench.main(["--goodput", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and all(f in out for f in ("--slo-ttft-p99", "--slo-itl-p99", "--target-rpm", "--json"))
    # refused before any request is sent (nothing listens on port 9)
    assert bench.main(["--goodput", "--url", "127.0.0.1:9", "--slo-ttft-p99", "0"]) == 2
    assert bench.main(["--goodput", "--url", "127.0.0.1:9", "--rate", "5", "--max-rate", "2"]) == 2


class RefusingServer:
    """A ServerTarget whose every request fails (a server missing an output the client asks for)."""
    name, mode = "server-grpc", "inflight"
    runs = 0

    def __init__(self, *args, **kwargs):
        pass

    def run(self, items, concurrency, progress=False):
        RefusingServer.runs += 1
        return {"num_requests": len(items), "completed": 0, "failed": len(items), "ttft_p99_s": None,
                "itl_p99_s": None, "errors": ["GenerationError: unexpected inference output 'x'"]}


@pytest.mark.parametrize("warmup", ["0", "1"])
def test_a_server_that_fails_every_request_stops_the_search_at_once_with_its_error(monkeypatch, capsys, warmup):
    from client.tools.benchmarks import targets

    monkeypatch.setattr(targets, "ServerTarget", RefusingServer)
    RefusingServer.runs = 0
    assert bench.main(["--goodput", "--warmup", warmup, "--no-progress"]) == 1
    assert RefusingServer.runs == 1  # not a search down to --min-rate, paying each rate's duration
    assert "unexpected inference output 'x'" in capsys.readouterr().err
