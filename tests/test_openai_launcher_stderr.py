"""The OpenAI server started by serving/openai_launcher.py keeps answering after it has written far
more to its stderr than a pipe holds (64 KiB on Linux): the launcher reads the pipe as it comes, where
a pipe nobody read would block the server on its next log line. A real `python -m openai_server`
process (no Triton behind it: /v1/models answers on its own), made to log by requests uvicorn warns
about (an Upgrade it does not support: one warning line each). A server that exits at start still
says why: the end of its stderr is in the error."""
import socket

import pytest

from serving.openai_launcher import OpenAIServer, OpenAIServerError
from serving.triton_launcher import free_port

PIPE_BYTES = 64 * 1024
REQUESTS = 4000  # ~40 bytes of warning each: ~160 KB, well past a pipe's 64 KiB


def upgrade_requests(url: str, count: int, timeout: float = 10.0) -> int:
    """`count` pipelined GET /v1/models on one connection, each asking to upgrade to h2c (uvicorn
    answers it and logs "Unsupported upgrade request."); returns how many answers came back before
    the connection closed or went quiet for `timeout` seconds."""
    host, port = url.removeprefix("http://").split(":")
    request = (f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n").encode()
    status = b"HTTP/1.1 200 "
    answers, tail = 0, b""
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request * count)
        try:
            while answers < count:
                got = sock.recv(1 << 16)
                if not got:
                    break
                answers += (tail + got).count(status)
                tail = got[-(len(status) - 1):]  # a status line cut between two reads is counted once
        except socket.timeout:
            pass
    return answers


def test_the_server_answers_after_writing_more_than_a_pipe_holds_to_stderr():
    with OpenAIServer(f"127.0.0.1:{free_port()}") as api:  # nothing listens on this gRPC port
        assert upgrade_requests(api.url, REQUESTS) == REQUESTS
        assert api.stderr_bytes > 2 * PIPE_BYTES, api.stderr_bytes  # it did write that much
        assert "Unsupported upgrade request." in api.stderr_tail[-1]
        assert api.is_up()  # and still answers a new connection
        assert api.process.poll() is None


def test_a_server_that_exits_at_start_says_why():
    server = OpenAIServer(f"127.0.0.1:{free_port()}", extra_args=("--log-level", "loud"))
    with pytest.raises(OpenAIServerError, match=r"(?s)exited with code 2:.*--log-level: invalid choice: 'loud'"):
        server.start()
