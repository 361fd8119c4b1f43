"""The OpenAI server's HTTP front door, against the real uvicorn process (no Triton behind it: every
case here is answered before a request would reach Triton): the body-size limit is enforced while
the body is read, a deeply nested body and a null message content are 400s, and a token id the
INT32 input cannot carry is a 400 naming it, never a wrapped id or a 500."""
import json
import socket
import time

import pytest

from chat_models import with_chat_template
from openai_server.request_body import MAX_BODY_BYTES
from serving.openai_launcher import OpenAIServer
from serving.triton_launcher import free_port

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content + '' }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def api(default_model_dir, tmp_path_factory):
    # TEMPLATE fails on a None content, as many real templates do
    path = with_chat_template(default_model_dir, tmp_path_factory.mktemp("chat-model") / "m", TEMPLATE)
    # Nothing listens on this gRPC port: a request that got past validation would be a 503.
    with OpenAIServer(f"127.0.0.1:{free_port()}", path) as server:
        yield server


def raw_post(api, path: str, head: dict, body_parts, read_timeout: float = 30.0) -> tuple[int, bytes, int]:
    """POST over a plain socket: a thread sends `body_parts` one by one while this one waits for
    the answer. Returns (status, body, bytes of the body sent when the answer came)."""
    import threading

    host, port = api.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=read_timeout)
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in head.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    sent, answered = [0], threading.Event()

    def send():
        try:
            for part in body_parts:
                if answered.is_set():
                    return
                sock.sendall(part)
                sent[0] += len(part)
        except OSError:  # the server closed the connection after answering
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    answer = b""
    try:
        while b"\r\n\r\n" not in answer:
            got = sock.recv(65536)
            if not got:
                break
            answer += got
        answered.set()
        at_answer = sent[0]
        sock.settimeout(5)
        try:
            while got := sock.recv(65536):
                answer += got
        except OSError:
            pass
    finally:
        answered.set()
        sock.close()
    head_text, _, body = answer.partition(b"\r\n\r\n")
    return int(head_text.split()[1]), body, at_answer


def chunked(total: int, piece: int = 64 << 10):
    sent = 0
    while sent < total:
        n = min(piece, total - sent)
        yield f"{n:x}\r\n".encode() + b" " * n + b"\r\n"
        sent += n


def test_a_declared_body_past_the_limit_is_refused_before_it_is_read(api):
    status, body, sent = raw_post(api, "/v1/completions", {"Content-Length": str(300 << 20)},
                                  (b" " * (64 << 10) for _ in range(4800)))
    assert status == 413 and b"the limit is" in body
    assert sent < 64 << 20, f"{sent} bytes went out before the 413"


def test_a_chunked_body_is_refused_once_past_the_limit_not_after_it_is_all_read(api):
    """A chunked upload of 300 MB: the 413 comes after about the limit, while the client is still
    sending (buffering the whole body first would have waited for all of it)."""
    status, body, sent = raw_post(api, "/v1/completions", {"Transfer-Encoding": "chunked"},
                                  chunked(300 << 20))
    assert status == 413 and b"over" in body
    assert MAX_BODY_BYTES < sent < MAX_BODY_BYTES + (16 << 20), f"{sent} bytes went out before the 413"


def post(api, path, body: bytes):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{api.url}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_deeply_nested_body_is_a_400(api):
    deep = b'{"model": "llm", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = post(api, "/v1/completions", deep)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    started = time.monotonic()
    status, _ = post(api, "/v1/completions", b'{"model": "llm", "prompt": "still up", "max_tokens": 1}')
    assert status == 503 and time.monotonic() - started < 10  # validated, then no Triton behind it


def test_a_null_message_content_is_a_400_naming_it(api):
    for content in (None, 5):
        status, body = post(api, "/v1/chat/completions", json.dumps(
            {"model": "llm", "messages": [{"role": "user", "content": content}]}).encode())
        assert status == 400, body
        assert body["error"]["param"] == "messages" and "messages[0].content" in body["error"]["message"]


@pytest.mark.parametrize("bad", [4294967301, 2**63, -1, 2**31])
def test_token_ids_the_input_cannot_carry_are_a_400_naming_them(api, bad):
    status, body = post(api, "/v1/completions", json.dumps({"model": "llm", "prompt": [1, bad]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    assert str(bad) in body["error"]["message"]
