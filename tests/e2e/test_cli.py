"""The `inflight` command line against real servers: `generate` prints what the engine makes, and
`serve` runs the OpenAI server beside Triton (its banner prints the /v1 address, the `openai` SDK
gets an answer) and stops on SIGINT / SIGTERM mid-stream, ending the stream with `abort` and leaving
no tritonserver, stub or OpenAI server process behind."""
import os
import re
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from client.cli import main
from client.grpc_client import GrpcClient
from serving.triton_launcher import free_port

from .conftest import inflight_serve, requires_tritonserver, stop_serve, wait_until

openai = pytest.importorskip("openai")
pytestmark = requires_tritonserver


def test_generate_prints_the_answer_over_grpc_and_http(server, llm, capsys):
    ref = llm.greedy("Hello world", 12)
    assert main(["generate", "Hello world", "--stream", "--url", server.grpc_url,
                 "--max-tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == ref.text + "\n"
    assert main(["generate", "Hello world", "--url", f"http://{server.http_url}",
                 "--max-tokens", "12", "--temperature", "0", "--echo"]) == 0
    assert capsys.readouterr().out == "Hello world" + ref.text + "\n"


def test_generate_reports_a_bad_request(server, capsys):
    assert main(["generate", "hi", "--url", server.grpc_url, "--top-p", "3"]) == 1
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_cleanly_mid_stream(model_repository, model_path, sig):
    http, grpc, metrics, openai_port = free_port(), free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "serve", "--model-repository", str(model_repository),
         "--model-path", str(model_path), "--host", "127.0.0.1", "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai_port),
         "--param", "max_model_len=512"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "is ready" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(120), "".join(lines[-30:])
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("tritonserver" in c.name() for c in children)
        assert any("stub" in " ".join(c.cmdline()) for c in children)
        assert any("openai_server" in " ".join(c.cmdline()) for c in children)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{openai_port}/v1", api_key="unused", max_retries=0)
        assert api.completions.create(model="llm", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        chunks = []
        with GrpcClient(f"127.0.0.1:{grpc}") as client:
            for chunk in client.stream("Stream until stopped", max_tokens=480, ignore_eos=True):
                chunks.append(chunk)
                if len(chunks) == 3:
                    os.kill(proc.pid, sig)  # as Ctrl-C / `kill` would
        assert chunks[-1].finish_reason == "abort" and len(chunks) < 480
        assert proc.wait(30) == 0
        reader.join(5)
        assert "inflight serve: stopping" in "".join(lines)
        assert f"http://localhost:{openai_port}/v1" in "".join(lines)   # the banner's OpenAI address
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"left behind: {[' '.join(p.cmdline()) for p in alive]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_starts_tritonserver_again_when_the_models_process_dies(model_repository, model_path):
    """kill -9 of the llm stub under `inflight serve` (what a stub stalled a second mid-request ends
    in, docs/reliability.md): it notices, starts tritonserver again on the same ports, and serves,
    through Triton's ports and through the OpenAI server it left running."""
    from client.http_client import HttpClient

    http, grpc, metrics, openai_port = free_port(), free_port(), free_port(), free_port()
    proc, lines = inflight_serve(["--model-repository", str(model_repository), "--model-path", str(model_path),
                                  "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                                  str(metrics), "--openai-port", str(openai_port), "--param", "max_model_len=512"])
    try:
        stubs = [c for c in psutil.Process(proc.pid).children(recursive=True) if "/llm/1/" in " ".join(c.cmdline())]
        assert len(stubs) == 1
        stubs[0].kill()
        wait_until(lambda: "inflight serve: ready again" in "".join(lines), timeout=180, interval=0.2)
        said = "".join(lines)
        # the stub's death, or tritonserver's own crash after it (SIGABRT in some runs: docs/reliability.md)
        assert (f"the Python stub(s) [{stubs[0].pid}] of its models died; starting tritonserver again" in said
                or re.search(r"tritonserver exited with code -\d+; starting tritonserver again", said)), said[-3000:]
        out = HttpClient(f"127.0.0.1:{http}").generate("after the restart", max_tokens=3, ignore_eos=True)
        assert out.finish_reason == "length" and proc.poll() is None
        # the OpenAI server beside it (its own process, kept) reaches the new tritonserver on the same port
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{openai_port}/v1", api_key="unused", max_retries=0)
        assert api.completions.create(model="llm", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        stop_serve(proc)
