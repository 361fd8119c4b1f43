"""`inflight serve`'s watch once ready (client/serve.py `supervise`): a dead tritonserver or model stub is
started again, unless --no-restart, and a second death within RESTART_INTERVAL of that ends the serve
(a crash loop). The server here is a stand-in that reports the failures it is given; the real restart
is tests/e2e/test_cli.py's (kill -9 of the stub under `inflight serve`)."""
from types import SimpleNamespace

import pytest

from client import serve
from serving.stub_watch import RESTART_INTERVAL

DIED = "the Python stub(s) [7] of its models died"
ABORTED = "tritonserver exited with code -6"


class Server:
    def __init__(self, failures):
        self.failures = list(failures)
        self.restarts = 0
        self.recoveries: list[str] = []
        self.process = SimpleNamespace(returncode=-6)

    def failure(self):
        if not self.failures:
            raise AssertionError("watched past the last failure: it should have exited")
        return self.failures.pop(0)

    def restart(self, timeout):
        self.restarts += 1


@pytest.fixture
def clock(monkeypatch):
    """serve.py's time: sleep advances a clock that monotonic reads."""
    now = [1000.0]
    monkeypatch.setattr(serve.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(serve.time, "monotonic", lambda: now[0])
    return now


def serve_args(no_restart=False):
    return SimpleNamespace(no_restart=no_restart, ready_timeout=5.0)


def test_a_death_is_started_again_and_a_second_soon_after_ends_the_serve(clock, capsys):
    server = Server([None, DIED, None, None, ABORTED])
    assert serve.supervise(server, serve_args()) == -6
    assert server.restarts == 1
    err = capsys.readouterr().err
    assert f"inflight serve: {DIED}; starting tritonserver again" in err and "ready again" in err
    assert f"inflight serve: {ABORTED} within {RESTART_INTERVAL:.0f} s of starting it again: not starting it again" in err


def test_deaths_further_apart_than_the_interval_are_each_started_again(clock):
    quiet = int(RESTART_INTERVAL / 0.5) + 1  # polls of 0.5 s: just over the interval
    server = Server([DIED] + [None] * quiet + [ABORTED] + [None] * quiet + [DIED, DIED])
    assert serve.supervise(server, serve_args()) == -6
    assert server.restarts == 3


def test_no_restart_exits_at_the_first_death(clock, capsys):
    server = Server([None, None, DIED])
    assert serve.supervise(server, serve_args(no_restart=True)) == -6
    assert server.restarts == 0
    assert capsys.readouterr().err.strip() == f"inflight serve: {DIED}"


def test_the_restarts_own_recoveries_are_printed(clock, capsys):
    server = Server([DIED, None, DIED])

    def restart(timeout):
        server.restarts += 1
        server.recoveries.append("tritonserver gave up on stub(s) [9] while they initialized")
    server.restart = restart
    serve.supervise(server, serve_args())
    assert "inflight serve: tritonserver gave up on stub(s) [9] while they initialized" in capsys.readouterr().err
