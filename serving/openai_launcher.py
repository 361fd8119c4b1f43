"""Start and stop the OpenAI server as its own process beside tritonserver: what `inflight serve`
runs (port 9000 by default) and what the tests start.

    with OpenAIServer(triton.grpc_url, model_path, port=0) as api:   # 0: a free loopback port
        print(api.url)                                              # http://127.0.0.1:PORT/v1/...

Its own process keeps the HTTP event loop off the interpreter that watches tritonserver, and it
dies with the process that started it (Linux), like tritonserver itself. Unless it logs to the
console, a thread reads its stderr as it comes and keeps the last STDERR_TAIL_LINES lines for the
error of a server that exits early: a pipe nobody read would fill (64 KiB on Linux) and block the
server on its next log line.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import IO, Optional

from openai_server.auth import ENV_KEYS
from serving.process_group import die_with_parent
from serving.triton_launcher import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
STDERR_TAIL_LINES = 200  # of the server's stderr, kept for the error of a server that exits early


class OpenAIServerError(RuntimeError):
    """The OpenAI server exited or did not answer in time."""


class OpenAIServer:
    def __init__(self, grpc_url: str, model_path: Optional[str | Path] = None, *, host: str = "127.0.0.1",
                 port: int = 0, log_to_console: bool = False, tool_call_parser: str = "hermes",
                 metrics_url: Optional[str] = None, reasoning_parser: Optional[str] = None,
                 extra_args: tuple[str, ...] = (), api_keys: tuple[str, ...] = ()):
        self.grpc_url = grpc_url
        self.model_path = str(model_path) if model_path else None
        self.host = host
        self.port = port or free_port()
        self.log_to_console = log_to_console
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser  # None: answers are not split into reasoning and content
        self.metrics_url = metrics_url  # Triton's, re-served on /metrics (None: the gRPC host, port 8002)
        self.extra_args = tuple(extra_args)  # more `python -m openai_server` flags (--max-chat-messages N)
        # --api-key's keys, handed over in INFLIGHT_API_KEY (not argv, which `ps` shows every user)
        self.api_keys = tuple(api_keys)
        self.process: Optional[subprocess.Popen] = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self.stderr_bytes = 0  # read from its stderr so far (not logging to the console)
        self._stderr_reader: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def check_port(self) -> None:
        """Raise OpenAIServerError unless the port is free (an answer on a port someone else holds
        would pass for ours in start())."""
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.port))
            except OSError as exc:
                raise OpenAIServerError(f"port {self.port} on {self.host} is not free for the OpenAI "
                                        f"server ({exc.strerror})") from None

    def start(self, timeout: float = 60.0) -> "OpenAIServer":
        self.check_port()
        cmd = [sys.executable, "-m", "openai_server", "--grpc-url", self.grpc_url,
               "--host", self.host, "--port", str(self.port), "--tool-call-parser", self.tool_call_parser]
        if self.model_path:
            cmd += ["--model-path", self.model_path]
        if self.metrics_url:
            cmd += ["--metrics-url", self.metrics_url]
        cmd += list(self.extra_args)
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
        out = None if self.log_to_console else subprocess.DEVNULL
        env = {**os.environ, ENV_KEYS: ",".join(self.api_keys)} if self.api_keys else None
        self.process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stdin=subprocess.DEVNULL, env=env,
                                        stderr=None if self.log_to_console else subprocess.PIPE,
                                        preexec_fn=die_with_parent)
        if self.process.stderr is not None:
            self.stderr_tail.clear()
            self._stderr_reader = threading.Thread(target=self._read_stderr, args=(self.process.stderr,),
                                                   name=f"openai-server-stderr-{self.port}", daemon=True)
            self._stderr_reader.start()
        deadline = time.monotonic() + timeout
        while not self.is_up():
            if self.process.poll() is not None:
                if self._stderr_reader is not None:
                    self._stderr_reader.join(5.0)  # it ends at the pipe's end, once the process is gone
                err = "".join(self.stderr_tail)
                raise OpenAIServerError(f"the OpenAI server exited with code {self.process.returncode}"
                                        + (f":\n{err[-2000:]}" if err else ""))
            if time.monotonic() > deadline:
                self.stop()
                raise OpenAIServerError(f"the OpenAI server did not answer on {self.url} in {timeout:.0f}s")
            time.sleep(0.1)
        return self

    def _read_stderr(self, pipe: IO[bytes]) -> None:
        """Read the server's stderr to its end (the pipe never fills), keeping its last lines."""
        with pipe:
            for line in iter(lambda: pipe.readline(65536), b""):  # a line without its end: in 64 KiB parts
                self.stderr_bytes += len(line)
                self.stderr_tail.append(line.decode(errors="replace"))

    def is_up(self) -> bool:
        headers = {"Authorization": f"Bearer {self.api_keys[0]}"} if self.api_keys else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{self.url}/v1/models", headers=headers),
                                        timeout=2) as r:
                return r.status == 200
        except urllib.error.HTTPError as exc:
            return exc.code == 401  # it answers, and wants a key it was given in its environment
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.process = self.process, None
        reader, self._stderr_reader = self._stderr_reader, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # uvicorn closes its connections, which cancels their Triton requests
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if reader is not None:
            reader.join(5.0)  # the pipe ends with the process

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
