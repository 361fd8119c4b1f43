"""Start and stop the real `tritonserver` binary that the nvidia-pytriton wheel ships.

`TritonServer` is both what `inflight serve` runs and a context manager for tests and benchmarks:

    with TritonServer(params={"max_num_seqs": "8"}) as server:   # free loopback ports
        print(server.grpc_url, server.http_url, server.metrics_url)

The server always runs on a *run copy* of the model repository (serving/run_repository.py: the
user's `config.pbtxt` with only the `--param`/`--model-path` overrides applied), with the binary,
stub and environment serving/triton_install.py finds; what its log says is read by
serving/triton_log.py. Here: the process, its ports, its readiness (and the recovery of a stub
stalled in its start, serving/stub_watch.py), its failure and restart, and its stop.
"""
from __future__ import annotations

import logging
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional

from backend.core.kv_events_config import HOST_ENV
from serving import proc_stacks, shm_regions, stub_watch
from serving.ports import free_port, free_ports  # noqa: F401 (public here)
from serving.process_group import die_with_parent, killpg, wait_group_gone
from serving.run_repository import DEFAULT_MODEL_REPOSITORY, MODEL_NAME, make_run_repository  # noqa: F401 (public here)
from serving.triton_install import ServerError, ensure_python_stub, find_tritonserver, server_env  # noqa: F401
from serving.triton_log import ENGINE_REPORT, engine_reports, load_errors, log_excerpt  # noqa: F401

STOP_FILE = ".inflight-stopping"  # model.py aborts its running requests when this appears
log = logging.getLogger(__name__)


class TritonServer:
    """One tritonserver process serving the `llm` model; a context manager.

    Ports default to free loopback ports (tests, benchmarks); `inflight serve` passes 8000/8001/8002
    and its --host (127.0.0.1 unless told otherwise: tritonserver's --http-address, --grpc-address
    and --metrics-address all get it, and the model's KV-event ports through INFLIGHT_HOST;
    tritonserver's own default is every interface). The server log goes to a temporary file (`log_text()`, `last_log` after
    `stop()`), and the reason a model failed to load goes into the error `wait_ready` raises;
    `log_to_console=True` shows the log live instead. tritonserver gets SIGTERM if the process
    that started it dies (Linux), so call `start()` from a thread that outlives the server.
    """

    def __init__(self, model_repository: Path | str = DEFAULT_MODEL_REPOSITORY, *,
                 params: Optional[Mapping[str, str]] = None, model_path: Optional[str] = None,
                 host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, log_verbose: int = 0, log_to_console: bool = False,
                 exit_timeout: int = 5,
                 extra_args: tuple[str, ...] = (), env: Optional[Mapping[str, str]] = None):
        self.model_repository = Path(model_repository)
        self.params = {k: str(v) for k, v in (params or {}).items()}
        self.model_path = model_path
        self.host = host
        chosen = iter(free_ports(3))  # distinct: the ones given are used as they are
        self.http_port = http_port or next(chosen)
        self.grpc_port = grpc_port or next(chosen)
        self.metrics_port = metrics_port or next(chosen)
        self.log_verbose = log_verbose
        self.log_to_console = log_to_console
        self.exit_timeout = exit_timeout  # on stop, seconds in-flight requests get to finish
        self.extra_args = tuple(extra_args)
        self._env = env
        self.process: Optional[subprocess.Popen] = None
        self._repository: Optional[Path] = None
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        self.log_path: Optional[Path] = None
        self.last_log = ""  # the whole log of the last run, kept after stop()
        self._log = None
        self.shm_prefix = shm_regions.new_prefix()  # its stubs' /dev/shm regions, removed by stop()
        self.shm_left = 0  # how many of them the last stop() found left behind (a killed server's)
        self.recoveries: list[str] = []  # what wait_ready did about stubs Triton gave up on (stub_watch.py)
        self._ready_stubs: list[int] = []  # the stubs serving when wait_ready last returned

    # -- addresses ---------------------------------------------------------------------------
    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    # -- life cycle --------------------------------------------------------------------------
    def command(self, repository: Path, backend_dir: Path, binary: Path) -> list[str]:
        return [
            str(binary),
            f"--model-repository={repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            "--strict-readiness=true", "--exit-on-error=true", "--disable-auto-complete-config",
            # Every model loads at start as in the default mode, and a model whose engine stopped
            # serving can unload itself so that Triton reports it not ready (model.py).
            "--model-control-mode=explicit", "--load-model=*",
            f"--exit-timeout-secs={self.exit_timeout}",
            f"--log-verbose={self.log_verbose}",
            shm_regions.backend_config(self.shm_prefix),
            *self.extra_args,
        ]

    def start(self) -> "TritonServer":
        if self.process is not None:
            raise ServerError("already started")
        install = find_tritonserver()
        backend_dir = ensure_python_stub(install)
        self._tmp = tempfile.TemporaryDirectory(prefix="inflight-triton-")
        tmp = Path(self._tmp.name)
        repository = make_run_repository(tmp / "repository", self.model_repository,
                                         self.params, self.model_path)
        self._repository = repository
        cmd = self.command(repository, backend_dir, install.binary)
        if self.log_to_console:
            out = None
        else:
            self.log_path = tmp / "tritonserver.log"
            self._log = open(self.log_path, "wb")
            out = self._log
        # Its own session: Ctrl-C in a terminal reaches only us, and we stop it in order; and every
        # stub it forks stays in its process group, so nothing is left behind.
        env = {**server_env(install, self._env), HOST_ENV: self.host}  # KV-event ports bind it too
        self.process = subprocess.Popen(cmd, env=env, stdout=out,
                                        stderr=subprocess.STDOUT if out else None,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent)
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                    f"http://{self.http_url}/v2/models/{MODEL_NAME}/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def metrics_listening(self) -> bool:
        try:
            socket.create_connection((self._client_host, self.metrics_port), timeout=2).close()
            return True
        except OSError:
            return False

    def wait_ready(self, timeout: float = 300.0,
                   abandoned_after: float = stub_watch.ABANDONED_AFTER) -> "TritonServer":
        """Until the model is ready and every endpoint listens: tritonserver starts its metrics
        service after HTTP (41 ms later on a quiet 2-core machine), so a ready model alone once
        let a test's first scrape find the metrics port closed.

        A stub that tritonserver gave up on while it initialized (serving/stub_watch.py: Triton's
        Python backend then waits for it to exit, and it never does) is killed after
        `abandoned_after` seconds of that wait, and the server started again, on the same ports; so is
        a server that died of a known crash in Triton's own code (stub_watch.TRITON_START_CRASHES). At
        most stub_watch.RESTARTS times a call; `recoveries` says each time why."""
        if self.process is None:
            raise ServerError("not started")
        deadline = time.monotonic() + timeout
        watch = stub_watch.AbandonedStubs(self.process.pid, abandoned_after)
        before = len(self.recoveries)
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                crash = stub_watch.triton_start_crash(self.log_text())
                if (watch.killed or crash) and len(self.recoveries) - before < stub_watch.RESTARTS:
                    self._start_again(watch, crash, code)
                    watch = stub_watch.AbandonedStubs(self.process.pid, abandoned_after)
                    continue
                raise ServerError(f"tritonserver exited with code {code} before the model was ready"
                                  + self._log_excerpt())
            if self.is_ready() and self.metrics_listening():
                self._ready_stubs = self._stubs()
                return self
            watch.check(self._stubs())
            time.sleep(0.25)
        asked = self.dump_stub_stacks()
        raise ServerError(f"model '{MODEL_NAME}' not ready after {timeout:.0f}s (metrics port listening: "
                          f"{self.metrics_listening()}; {asked} stub(s) asked for their stacks)"
                          + self._log_excerpt(lines=120 if asked else 15) + self.thread_states())

    def _start_again(self, watch: stub_watch.AbandonedStubs, crash: Optional[str], code: int) -> None:
        """After a stub Triton gave up on was killed, or Triton crashed in its own code, and the
        server exited before ready: say so, start it again."""
        if watch.killed:
            reasons = "; ".join(self.load_errors()) or "see its log"
            note = (f"tritonserver gave up on stub(s) {watch.killed} while they initialized and waited for them "
                    f"to exit (Triton's Python backend: a stub that missed a 1-second health check); killed after "
                    f"{watch.after:.0f} s of that wait, the server exited ({reasons}) and was started again")
        else:
            note = (f"tritonserver crashed in its own code before the model was ready (exit {code}, '{crash}' in its "
                    f"log: a known fault of Triton's Python backend) and was started again")
        self.recoveries.append(note)
        log.warning("%s", note)
        self.stop()
        self.start()

    def failure(self) -> Optional[str]:
        """Why this server, once ready, can no longer serve: tritonserver exited, or a model's
        Python stub died (Triton 2.51 then still reports the model ready but fails every request,
        docs/reliability.md); None while both run."""
        if self.process is None:
            return "tritonserver is not running"
        code = self.process.poll()
        if code is not None:
            return f"tritonserver exited with code {code}"
        dead = stub_watch.gone(self._ready_stubs)
        return f"the Python stub(s) {dead} of its models died" if dead else None

    def restart(self, timeout: float = 300.0) -> "TritonServer":
        """Stop, start again on the same ports, and wait until ready."""
        self.stop()
        self.start()
        return self.wait_ready(timeout)

    def thread_states(self) -> str:
        """Every thread of tritonserver and of its stubs (serving/proc_stacks.py): state, kernel wait,
        the system call and what it waits on, the code on its stack; for the C++ side of a load that
        never finishes, which the stubs' Python stacks do not show."""
        if self.process is None:
            return ""
        pids = [self.process.pid, *proc_stacks.children(self.process.pid)]
        return proc_stacks.report(pids)

    def dump_stub_stacks(self, settle: float = 2.0) -> int:
        """SIGUSR1 to each Python-backend stub of this tritonserver: the models' initialize registers
        faulthandler on it (model_repository/llm/1/model.py), so every thread's Python stack goes to
        the log: where a load that never finishes stands. The number of stubs asked."""
        if self.process is None or self.process.poll() is not None:
            return 0
        return proc_stacks.ask_python_stacks(self._stubs(), settle)

    def _stubs(self) -> list[int]:
        """The pids of this tritonserver's Python-backend stubs."""
        return proc_stacks.stubs(self.process.pid)

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        if self._log:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def load_errors(self) -> list[str]:
        """The reasons Triton gave for models that failed to load, tracebacks cut off."""
        return load_errors(self.log_text() or self.last_log)

    def engine_reports(self) -> list[dict]:
        """What each `llm` instance logged at start: its effective EngineConfig ("config"), its
        engine thread's CPU team ("cpu_placement", each thread's cores) and the stub's OpenMP
        environment ("env"), to hold against an in-process engine's (issue 47)."""
        return engine_reports(self.log_text() or self.last_log)

    def _log_excerpt(self, lines: int = 15) -> str:
        return log_excerpt(self.log_text(), lines)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """Abort the running requests, SIGTERM (Triton unloads the model: `finalize` runs), then make
        sure nothing is left.

        Triton unloads a decoupled model only after every request it holds is answered, so a long
        stream would hold the exit up to its timeout; the stop file makes the model abort them all
        (each gets its FINAL response) first.
        """
        proc = self.process
        if proc is None:
            return None
        code = None
        try:
            if proc.poll() is None:
                if self._repository is not None:
                    (self._repository / MODEL_NAME / STOP_FILE).touch()
                proc.send_signal(signal.SIGTERM)
                try:
                    code = proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    killpg(proc.pid, signal.SIGKILL)
                    code = proc.wait(10)
            else:
                code = proc.returncode
            # A stub whose parent went away too early would linger in the group: end it.
            killpg(proc.pid, signal.SIGTERM)
            wait_group_gone(proc.pid, 5.0)
            killpg(proc.pid, signal.SIGKILL)
            # and gone, before the caller starts the next server: a stub of several GB still tearing
            # down its memory would compete with the next one's start (a second server once died at
            # load in a loaded test run, the Python backend's shared-memory mutex failing; since then
            # wait_ready starts such a server again: stub_watch.TRITON_START_CRASHES)
            wait_group_gone(proc.pid, 5.0)
        finally:
            self.shm_left = shm_regions.remove(self.shm_prefix)  # a killed tritonserver unlinks none
            self.process = None
            if self._log:
                self._log.close()
                self._log = None
            if self._tmp is not None:
                if self.log_path is not None and self.log_path.exists():
                    self.last_log = self.log_path.read_text(errors="replace")
                self._tmp.cleanup()
                self._tmp = None
                self.log_path = None
        return code

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

