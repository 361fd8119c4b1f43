"""The test tiers (tests/tiers.py): which tests `make test-fast` leaves out, and the guards that
fail a fast-tier test reaching the SmolLM2 download or a tritonserver, or taking too long. Each
case runs a small pytest session of its own in a subprocess (pytester), with the plugin loaded
the way tests/conftest.py loads it."""
import re
import textwrap
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
pytest_plugins = ["tiers"]


def pytest_configure(config):   # CPU limits that a test of a fraction of a second can cross; the wall-clock
    # one is crossed by moving the clock (a busy machine stretches any real wait)
    import tiers
    tiers.FAST_WARN_CPU_S, tiers.FAST_FAIL_CPU_S, tiers.FAST_FAIL_WALL_S = 0.02, 0.1, 60
    tiers.FAST_WARN_SHARED_CPU_S = 0.03
"""

INI = """
[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    slow: slow
    e2e: e2e
"""

# CPU work that no test here would do by accident: a busy loop of `seconds` of process time.
BUSY = """
import time
def busy(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
"""


@pytest.fixture(autouse=True)
def no_plugin_autoload(monkeypatch):
    """The sessions load only the plugins they name: a fifth of the start-up time (locust's alone
    is most of it)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def session(pytester, files: dict, *args):
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    pytester.makepyfile(busy=BUSY)
    for name, text in files.items():
        path = pytester.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return pytester.runpytest_subprocess(*args)


def collected(result) -> set:
    return {line.split("::")[-1] for line in result.outlines if "::" in line}


def test_the_fast_tier_leaves_out_e2e_marked_and_slow_resource_tests(pytester):
    files = {
        "test_unit.py": """
            import pytest

            def smollm2_dir():                      # a stand-in: only the call is looked for
                return None

            def TritonServer(*args):
                return None

            @pytest.fixture(scope="module")
            def served():
                return TritonServer("repo")

            @pytest.fixture
            def through_another(served):
                return served

            def test_plain():
                assert 1 + 1 == 2

            def test_downloads():
                smollm2_dir()

            def test_server_two_fixtures_away(through_another):
                pass

            @pytest.mark.slow
            def test_marked():
                pass

            def test_names_smollm2_dir_only_in_text():
                assert "smollm2_dir" in "smollm2_dir is called elsewhere"
            """,
        "e2e/test_served.py": """
            def test_end_to_end():
                pass
            """,
    }
    fast = session(pytester, files, "--collect-only", "-q", "-m", "not slow")
    assert collected(fast) == {"test_plain", "test_names_smollm2_dir_only_in_text"}
    slow = session(pytester, files, "--collect-only", "-q", "-m", "slow")
    assert collected(slow) == {"test_downloads", "test_server_two_fixtures_away", "test_marked", "test_end_to_end"}
    e2e = session(pytester, files, "--collect-only", "-q", "-m", "e2e")
    assert collected(e2e) == {"test_end_to_end"}


def test_a_fast_test_reaching_smollm2_or_a_tritonserver_at_run_time_fails_naming_it(pytester):
    files = {
        "helpers.py": """
            from smollm2 import smollm2_dir as fetch          # hidden from the collection-time look
            from serving.triton_launcher import TritonServer as Server

            def model():
                return fetch()

            def start(path):
                return Server(path).start()
            """,
        "test_hidden.py": """
            import pytest
            import helpers

            def test_model():
                helpers.model()

            def test_server(tmp_path):
                helpers.start(tmp_path)

            @pytest.mark.slow
            def test_marked_may_start_it(tmp_path, monkeypatch):
                from serving import triton_launcher as server
                monkeypatch.setattr(server, "find_tritonserver", lambda: 1 / 0)   # stop right after the guard
                with pytest.raises(ZeroDivisionError):
                    helpers.start(tmp_path)
            """,
    }
    result = session(pytester, files, "-q")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "*test_hidden.py::test_model reaches the SmolLM2 download (smollm2_dir) but is not marked slow*",
        "*test_hidden.py::test_server reaches a tritonserver (TritonServer.start) but is not marked slow*",
    ])


def test_a_fast_test_over_the_cpu_limit_fails_and_one_over_the_warning_is_listed(pytester):
    files = {
        "test_times.py": """
            import time
            import pytest
            from busy import busy

            @pytest.fixture(scope="module")
            def shared_model():
                busy(0.05)         # paid once for many tests: not the test's own time

            @pytest.fixture(scope="module")
            def huge_shared_model():
                busy(0.15)         # but it has the same limit

            @pytest.fixture
            def own_model():
                busy(0.15)

            def test_quick():
                pass

            def test_over_the_warning():
                busy(0.06)

            def test_over_the_limit():
                busy(0.15)

            def test_its_own_fixture_counts(own_model):
                pass

            def test_a_shared_fixture_does_not(shared_model):
                pass

            def test_a_shared_fixture_over_the_limit_fails_its_first_user(huge_shared_model):
                pass

            def test_waiting_counts_by_the_clock(monkeypatch):
                later = time.monotonic() + 61      # a minute of waiting, without the wait
                monkeypatch.setattr(time, "monotonic", lambda: later)

            @pytest.mark.slow
            def test_marked_slow_may_take_long():
                busy(0.15)

            def test_failing_for_its_own_reason():
                busy(0.15)
                assert False, "its own failure"
            """,
    }
    result = session(pytester, files, "-q", "--cpu-durations=3", "-m", "not slow")   # as make test-fast runs
    result.assert_outcomes(passed=3, failed=5, deselected=1)
    out = result.stdout.str()
    for name in ("test_over_the_limit", "test_its_own_fixture_counts", "test_waiting_counts_by_the_clock",
                 "test_a_shared_fixture_over_the_limit_fails_its_first_user"):
        assert re.search(rf"_ {name} _+\na fast-tier test took .* mark it @pytest.mark.slow", out), name
    assert re.search(r"_ test_failing_for_its_own_reason _+\n(.*\n)*E +AssertionError: its own failure", out)
    listed = out.split("fast-tier tests over the time of a quick test")[1].split("short test summary")[0]
    assert "test_times.py::test_over_the_warning  (the test)" in listed
    assert "test_times.py::test_a_shared_fixture_does_not  (the shared fixtures it built)" in listed
    assert "test_a_shared_fixture_does_not  (the test)" not in listed
    top = out.split("the 3 tests with the most CPU time")[1].splitlines()[1:4]
    assert {line.split("::")[1] for line in top} <= {
        "test_over_the_limit", "test_its_own_fixture_counts", "test_failing_for_its_own_reason",
        "test_a_shared_fixture_over_the_limit_fails_its_first_user"}, top
    # A run of everything (make test) only lists them; only a test's own failure fails it there.
    everything = session(pytester, files, "-q")
    everything.assert_outcomes(passed=8, failed=1)
    listed = everything.stdout.str().split("fast-tier tests over the time of a quick test")[1]
    assert "test_times.py::test_over_the_limit  (the test)" in listed
    assert "test_quick" not in listed and "test_marked_slow" not in listed


def test_tests_sharing_a_module_fixture_or_a_server_stay_on_one_xdist_worker_and_slow_ones_go_first(pytester):
    files = {
        "test_spread.py": """
            import os
            import pytest

            def TritonServer():
                return os.environ["PYTEST_XDIST_WORKER"]

            @pytest.fixture(scope="session")
            def server():
                return TritonServer()

            @pytest.fixture(scope="module")
            def module_model():
                return os.environ["PYTEST_XDIST_WORKER"]

            @pytest.mark.parametrize("i", range(6))
            def test_uses_server(server, i):
                assert server == os.environ["PYTEST_XDIST_WORKER"]   # built on this worker

            @pytest.mark.parametrize("i", range(6))
            def test_uses_module_model(module_model, i):
                assert module_model == os.environ["PYTEST_XDIST_WORKER"]

            @pytest.mark.parametrize("i", range(6))
            def test_alone(i):
                pass

            @pytest.mark.slow
            def test_slow_written_last():
                pass
            """,
    }
    result = session(pytester, files, "-p", "xdist", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "-v")
    result.assert_outcomes(passed=19)
    workers, order = {}, []
    for line in result.outlines:   # "[gw0] [ 5%] PASSED test_spread.py::test_uses_server[0]@<group>"
        if "PASSED" in line and "::" in line:
            name = line.split("::")[1].split("[")[0].split("@")[0].strip()
            workers.setdefault(name, set()).add(line.split("]")[0].lstrip("["))
            order.append(name)
    assert len(workers["test_uses_server"]) == 1 and len(workers["test_uses_module_model"]) == 1
    # handed out with the slow server group, before the six quick module tests and the rest
    assert order.index("test_slow_written_last") < 8, order
