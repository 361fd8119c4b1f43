"""Fixtures for the end-to-end tests: the default model, one real tritonserver for the session.

The server runs on free loopback ports from a temporary model repository: the config rendered
from templates/llm/config.pbtxt (KIND_CPU here), with `llm/1` linked to the repository's code.
It is always stopped, and no stub process is left behind.
"""
import time
from pathlib import Path

import pytest
from adapter_module import load_adapter  # noqa: F401  (the e2e tests import it from here)

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / "model_repository" / "llm" / "1"

LOG_LINES_ON_FAILURE = 200


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the last lines of the log of every tritonserver among its
    fixtures: a server fixture's log is a temporary file removed at teardown, and an intermittent
    failure (a stream cut, a model process that died) is otherwise not told from its client's side."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    from serving.triton_launcher import TritonServer

    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, TritonServer):
            lines = (value.log_text() or value.last_log).splitlines()[-LOG_LINES_ON_FAILURE:]
            report.sections.append((f"tritonserver log of fixture {name!r} (its last {len(lines)} lines)",
                                    "\n".join(lines)))


# Small enough that the too-long-prompt case is cheap; the in-process reference uses the same.
MAX_MODEL_LEN = 512
HAND_EDITED_KV_TOKENS = 16384
SERVER_PARAMS = {"max_model_len": str(MAX_MODEL_LEN), "max_num_seqs": "64"}


def grpc_error(server, tensors, request_id: str = "", timeout: float = 30) -> str:
    """Send hand-made tensors [(name, array, Triton dtype)] (wrong types, shapes, sizes) over the
    gRPC stream; return the error text of the first response, failing if it was accepted."""
    import threading

    import tritonclient.grpc as grpcclient

    got: list = []
    done = threading.Event()
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def callback(result, error):
        got.append(error)
        done.set()

    client.start_stream(callback)
    try:
        inputs = []
        for name, array, dtype in tensors:
            t = grpcclient.InferInput(name, list(array.shape), dtype)
            t.set_data_from_numpy(array)
            inputs.append(t)
        client.async_stream_infer("llm", inputs, request_id=request_id)
        assert done.wait(timeout), "no answer"
    finally:
        client.stop_stream()
        client.close()
    assert got[0] is not None, "the request was accepted"
    return got[0].message()


def _has_tritonserver() -> bool:
    try:
        from serving.triton_install import find_tritonserver
        find_tritonserver()
        return True
    except Exception:
        return False


requires_tritonserver = pytest.mark.skipif(
    not _has_tritonserver(), reason="nvidia-pytriton (the local tritonserver) is not installed")


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    from backend.models.make_model import make_model

    path = tmp_path_factory.mktemp("models") / "default"
    make_model(path)
    return path


def cpu_repository(root: Path, count: int = 1) -> Path:
    """A model repository in `root` as `make config` writes it for the CPU (`count` instances of
    `llm`), its version folder a link to this checkout's model.py. Returns `root`."""
    from templates.render import write_config

    write_config(root / "llm" / "config.pbtxt", gpus=[], count=count)
    (root / "llm" / "1").symlink_to(MODEL_DIR, target_is_directory=True)
    return root


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    repo = cpu_repository(tmp_path_factory.mktemp("model_repository"))
    config = repo / "llm" / "config.pbtxt"
    # A hand edit, as a user would make it: the server must pick it up (test_metrics checks).
    text = config.read_text()
    edited = text.replace('key: "cpu_kv_cache_tokens" value: { string_value: "65536" }',
                          f'key: "cpu_kv_cache_tokens" value: {{ string_value: "{HAND_EDITED_KV_TOKENS}" }}')
    assert edited != text
    config.write_text(edited)
    return repo


@pytest.fixture(scope="session")
def server(model_repository, model_path):
    from serving.triton_launcher import TritonServer

    with TritonServer(model_repository, params=SERVER_PARAMS, model_path=str(model_path)) as srv:
        yield srv


class Reference:
    """The in-process engine on the same checkpoint: the reference for what the server returns."""

    def __init__(self, model_path):
        from backend import LLM

        self.llm = LLM(str(model_path), max_model_len=MAX_MODEL_LEN)
        self._cache = {}

    def generate(self, prompts, params):
        return self.llm.generate(prompts, params)

    def greedy(self, prompt, max_tokens):
        """The greedy output for one prompt (memoized)."""
        from backend import SamplingParams

        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens)
        if key not in self._cache:
            self._cache[key] = self.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
        return self._cache[key]


@pytest.fixture(scope="session")
def llm(model_path):
    return Reference(model_path)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01):
    """Poll predicate until it returns something truthy (returned), or fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def inflight_serve(args, timeout: float = 120.0):
    """`inflight serve ARGS` (the `make serve` path) in its own session, started once its banner
    ("Ctrl-C stops") is printed: (process, its output lines so far). The caller stops it, and must
    kill its session in a `finally` (`stop_serve`)."""
    import subprocess
    import sys
    import threading

    from tiers import require_slow

    require_slow("a tritonserver (inflight serve)")
    proc = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, ready = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout):
        where = serve_threads(proc.pid)  # a load that never finishes: where tritonserver and its stubs wait
        stop_serve(proc)
        raise AssertionError("inflight serve did not start:\n" + "".join(lines[-30:]) + where)
    return proc, lines


def serve_threads(pid: int) -> str:
    """Every thread of `inflight serve`'s processes (tritonserver and its stubs: serving/proc_stacks.py)."""
    import psutil

    from serving import proc_stacks

    try:
        pids = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return ""
    return proc_stacks.report(pids)


def stop_serve(proc, timeout: float = 60.0) -> None:
    """Ctrl-C, then the whole session killed if it is still there."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
