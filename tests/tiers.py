"""The test tiers, as a pytest plugin (tests/conftest.py loads it): `make test-fast` runs the tests
not marked `slow`, `make test` runs them all (README, "Tests").

A test is slow when it is marked so by hand (more than ~3 s), lives under tests/e2e/ (marked `e2e`
here, which implies `slow`), or reaches a slow resource: the SmolLM2 download or a tritonserver.
The last is found without a mark, because tests are written on many branches at once: a test whose
own source, or the source of a fixture it uses (directly or through other fixtures), calls one of
SLOW_CALLS is marked slow at collection. Three guards keep the fast tier honest (the time limits fail a test only in a fast-tier run):
- a fast test that still reaches a slow resource at run time (through a helper elsewhere) fails,
  naming the resource (`require_slow`, called by tests/smollm2.py, `TritonServer.start` and
  tests/e2e/conftest.py's `inflight_serve`);
- a fast test that spends more than FAST_FAIL_CPU_S seconds of CPU (its own set-up and call, this
  process and the children it waited for) fails; over FAST_WARN_CPU_S it is listed at the end of
  the run as one to mark slow. CPU time, not wall time: the suite runs beside other work on two
  cores, and a wall-clock limit would fail a quick test on a busy machine. A module- or
  session-scoped fixture, paid once for many tests, is counted apart, with the same limit.
- a fast test that takes more than FAST_FAIL_WALL_S wall-clock seconds with its set-up fails too
  (a sleep or a wait costs no CPU), not counting the time its threads spent queued for a CPU
  behind other work (Linux schedstat), so that a busy machine does not stretch a quick test past
  it.

Under pytest-xdist's `--dist loadgroup` (the Makefile's), tests that share a module-scoped fixture,
or a session-scoped one that starts a tritonserver, run on one worker, so that the server or model
is built once; the others are spread one by one.
"""
from __future__ import annotations

import functools
import inspect
import os
import re
import resource
import time
from pathlib import Path
from typing import Optional

import pytest

E2E_DIR_NAME = "e2e"   # tests/e2e/: every test in a folder of this name is an e2e test

# Calls that reach a slow resource: a model download (tests/smollm2.py, tests/gemma3.py) or a tritonserver.
SLOW_CALLS = re.compile(r"\b(?:smollm2_dir|smollm2_packed_dir|smollm2_gguf|gemma3_dir|gemma3_gguf|TritonServer|"
                        r"inflight_serve)\(")

FAST_WARN_CPU_S = 3.0
FAST_WARN_SHARED_CPU_S = 10.0   # a module/session fixture that fast tests use, paid once
FAST_FAIL_CPU_S = 20.0
FAST_FAIL_WALL_S = 120.0   # generous: a child process's own queueing still counts here

_CPU_KEY, _SHARED_KEY, _TEARDOWN_KEY, _FAST_KEY = "tier_cpu_s", "tier_shared_cpu_s", "tier_teardown_cpu_s", "tier_fast"
_setup_times = pytest.StashKey[tuple]()   # (own CPU s, shared fixtures' CPU s, wall s)
_fast_test: Optional[str] = None   # the node id of the fast-tier test now running, if any
_shared_depth = 0                  # shared fixtures being set up, one inside another
_shared_cpu = 0.0                  # CPU seconds of the shared fixtures built for this test's set-up
_over_warn: list[tuple[str, str, float]] = []   # (what, node id, CPU s) of fast tests over the warnings
_cpu_by_test: dict[str, float] = {}               # node id: CPU s of set-up, call and teardown (--cpu-durations)


def fast_tier_run(config: pytest.Config) -> bool:
    """Whether this run is the fast tier (`-m "not slow"`, what `make test-fast` passes): the time
    limits fail a test only there, where they are the tier's promise. Elsewhere (`make test`, one
    file, `make test-compat`'s older interpreter) a fast test over the warning is listed only."""
    return "not slow" in (config.option.markexpr or "")


def require_slow(resource_name: str) -> None:
    """Fail the running test if it is in the fast tier: it reaches ``resource_name``."""
    if _fast_test is not None:
        pytest.fail(f"{_fast_test} reaches {resource_name} but is not marked slow: mark it "
                    f"@pytest.mark.slow (tests/tiers.py)", pytrace=False)


# -- classification ----------------------------------------------------------------------------

def _source_path(func) -> Optional[Path]:
    try:
        return Path(inspect.getsourcefile(inspect.unwrap(func)) or "").resolve()
    except TypeError:
        return None


@functools.lru_cache(maxsize=None)
def _own_source(func, root: Path) -> str:
    """The source of a test or fixture function written under ``root`` ('' for pytest's own)."""
    path = _source_path(func)
    if path is None or root not in path.parents or "site-packages" in path.parts:
        return ""
    try:
        return inspect.getsource(inspect.unwrap(func))
    except (OSError, TypeError):
        return ""


def _is_e2e(item: pytest.Item) -> bool:
    path = Path(item.path)
    try:
        folders = path.relative_to(item.config.rootpath).parts[:-1]
    except ValueError:   # a test outside the root folder
        folders = path.parts[:-1]
    return E2E_DIR_NAME in folders


def _fixture_defs(item: pytest.Item) -> list:
    """The definitions of every fixture in the item's closure (the last one is the one used)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [defs[-1] for name, defs in info.name2fixturedefs.items() if defs and name in item.fixturenames]


def slow_reason(item: pytest.Item) -> Optional[str]:
    """Why ``item`` belongs to the slow tier, or None."""
    if item.get_closest_marker("slow"):
        return "marked slow"
    if _is_e2e(item):
        return "under tests/e2e/"
    sources = [("the test", getattr(item, "function", None))]
    sources += [(f"fixture {d.argname}", d.func) for d in _fixture_defs(item)]
    for where, func in sources:
        found = SLOW_CALLS.search(_own_source(func, item.config.rootpath)) if func is not None else None
        if found:
            return f"{where} calls {found.group(0)}"
    return None


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures that keep the item on the same xdist worker as the other tests using them: the
    module-scoped ones written in the project, and the session-scoped ones that reach a slow
    resource (a tritonserver for the whole session). A cheap session fixture (the tiny model,
    written in a second) is built once per worker instead, so that it does not tie half the suite
    to one worker."""
    root = item.config.rootpath
    names = []
    for d in _fixture_defs(item):
        source = _own_source(d.func, root)
        if source and (d.scope in ("module", "class", "package") or SLOW_CALLS.search(source)):
            names.append(f"{_source_path(d.func).relative_to(root)}::{d.argname}")
    return names


def _xdist_groups(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    """Tests joined through shared fixtures (union-find), one group name per joined set of two or more."""
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for item in items:
        for name in _shared_fixtures(item):
            parent[find(item.nodeid)] = find(name)
    groups: dict[pytest.Item, str] = {}
    for item in items:
        root = find(item.nodeid)
        if root != item.nodeid:
            groups[item] = root.replace("/", ".").replace("::", ".")
    return groups


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects, and before xdist reads xdist_group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_e2e(item):
            item.add_marker("e2e")
        if slow_reason(item) and not item.get_closest_marker("slow"):
            item.add_marker("slow")
    if getattr(config.option, "loadgroup", False):   # set on xdist's workers under --dist loadgroup
        groups = _xdist_groups(items)
        scope = {item: groups.get(item, item.nodeid) for item in items}
        # The slow work first (the Makefile keeps this order: --no-loadscope-reorder), so that the
        # run ends on quick tests spread over both workers, not on one long test started last.
        slow_scopes = {scope[item] for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: scope[item] not in slow_scopes)
        for item, group in groups.items():
            _join_group(item, group)


def _join_group(item: pytest.Item, group: str) -> None:
    """What an `xdist_group` mark does under --dist loadgroup: the group name after an '@' at the
    end of the node id, where xdist's scheduler reads it. pytest-xdist 3.8 writes it into an
    attribute that pytest 9.2 no longer reads (pytest-xdist issue #1386), so that the mark is
    silently ignored; tests/test_tiers.py checks that the grouping holds."""
    nodeid = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):   # pytest >= 9.2: a structured node id
        item._id = type(item._id).parse(nodeid)
    else:
        item._nodeid = nodeid


# -- the run-time guards -----------------------------------------------------------------------

def _waited_s() -> float:
    """Seconds that this process's threads have spent runnable but waiting for a CPU (Linux
    schedstat; 0 where it cannot be read)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):   # a thread that ended meanwhile
            pass
    return total / 1e9


def _clock() -> float:
    """Wall-clock seconds less the time spent queued for a CPU: what a test takes on a machine
    where it does not wait for other work (sleeps and waits still count)."""
    return time.monotonic() - _waited_s()


def _cpu_s() -> float:
    """CPU seconds of this process (all threads) and of the children it has waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    global _fast_test
    _fast_test = None if item.get_closest_marker("slow") else item.nodeid
    try:
        return (yield)
    finally:
        _fast_test = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Counts the set-up of shared (module/session) fixtures apart: paid once for many tests, it is
    not the test's own time (but has a limit of its own)."""
    global _shared_depth, _shared_cpu
    if fixturedef.scope == "function":
        return (yield)
    start = _cpu_s()
    _shared_depth += 1
    try:
        return (yield)
    finally:
        _shared_depth -= 1
        if _shared_depth == 0:   # a shared fixture built inside another is counted once
            _shared_cpu += _cpu_s() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    global _shared_cpu
    _shared_cpu = 0.0
    start, wall_start = _cpu_s(), _clock()
    try:
        return (yield)
    finally:
        item.stash[_setup_times] = (_cpu_s() - start - _shared_cpu, _shared_cpu, _clock() - wall_start)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    cpu_start, wall_start = _cpu_s(), _clock()
    result = yield   # a failing test raises here: it fails for its own reason
    setup_own, shared, setup_wall = item.stash.get(_setup_times, (0.0, 0.0, 0.0))
    own = setup_own + _cpu_s() - cpu_start
    wall = setup_wall + _clock() - wall_start
    fast = not item.get_closest_marker("slow")
    item.user_properties += [(_CPU_KEY, round(own, 2)), (_SHARED_KEY, round(shared, 2)), (_FAST_KEY, fast)]
    over = own > FAST_FAIL_CPU_S or shared > FAST_FAIL_CPU_S or wall > FAST_FAIL_WALL_S
    if fast and over and fast_tier_run(item.config):
        pytest.fail(f"a fast-tier test took {own:.1f} s of CPU, its shared fixtures {shared:.1f} s, and "
                    f"{wall:.1f} s of wall time with its set-up (limits {FAST_FAIL_CPU_S:g} s of CPU each, "
                    f"{FAST_FAIL_WALL_S:g} s of wall time): mark it @pytest.mark.slow (tests/tiers.py)",
                    pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    """The teardown's CPU, for --cpu-durations: a server stopped here is waited for here, and its
    CPU time counted (a child's time is counted once it has been waited for)."""
    start = _cpu_s()
    try:
        return (yield)
    finally:
        item.user_properties.append((_TEARDOWN_KEY, round(_cpu_s() - start, 2)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="show the N tests that took the most CPU time (set-up, call and teardown; this "
                          "process and the children it waited for): on a shared machine, steadier than --durations")


def pytest_configure(config: pytest.Config) -> None:
    try:
        from serving.triton_launcher import TritonServer
    except ImportError:   # pragma: no cover (the project is not installed: nothing to guard)
        return
    start = TritonServer.start

    def guarded_start(self, *args, **kwargs):
        require_slow("a tritonserver (TritonServer.start)")
        return start(self, *args, **kwargs)

    guarded_start.unguarded = start
    TritonServer.start = guarded_start


def pytest_unconfigure(config: pytest.Config) -> None:
    try:
        from serving.triton_launcher import TritonServer
    except ImportError:   # pragma: no cover
        return
    TritonServer.start = getattr(TritonServer.start, "unguarded", TritonServer.start)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Here and not in pytest_runtest_call: under xdist only reports reach the controller.
    props = dict(report.user_properties)
    if report.when == "call" and props.get(_FAST_KEY):
        if props.get(_CPU_KEY, 0) > FAST_WARN_CPU_S:
            _over_warn.append(("the test", report.nodeid, props[_CPU_KEY]))
        if props.get(_SHARED_KEY, 0) > FAST_WARN_SHARED_CPU_S:
            _over_warn.append(("the shared fixtures it built", report.nodeid, props[_SHARED_KEY]))
    if report.when in ("call", "teardown"):   # the teardown report carries the call's properties too
        cpu = props.get(_CPU_KEY, 0) + props.get(_SHARED_KEY, 0) if report.when == "call" else props.get(_TEARDOWN_KEY, 0)
        _cpu_by_test[report.nodeid] = _cpu_by_test.get(report.nodeid, 0.0) + cpu


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    shown = config.getoption("cpu_durations", 0)
    if shown:
        terminalreporter.section(f"the {shown} tests with the most CPU time")
        for nodeid, cpu in sorted(_cpu_by_test.items(), key=lambda r: -r[1])[:shown]:
            terminalreporter.write_line(f"{cpu:8.2f} s  {nodeid}")
        terminalreporter.write_line(f"{sum(_cpu_by_test.values()):8.2f} s  in all ({len(_cpu_by_test)} tests)")
    if not _over_warn:
        return
    terminalreporter.section("fast-tier tests over the time of a quick test")
    terminalreporter.write_line(f"these are not marked slow but took more than {FAST_WARN_CPU_S:g} s of CPU "
                                f"(their module/session fixtures more than {FAST_WARN_SHARED_CPU_S:g} s): "
                                f"mark them @pytest.mark.slow or make them quicker")
    for what, nodeid, cpu in sorted(_over_warn, key=lambda r: -r[2]):
        terminalreporter.write_line(f"  {cpu:6.1f} s  {nodeid}  ({what})")
