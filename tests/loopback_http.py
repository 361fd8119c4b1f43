"""A stand-in HTTP server on the loopback interface, for tests of code that fetches over HTTP (the
OpenAI server's image URLs, the tools' /metrics scrapes, the llama.cpp peer runner): `serving(handler)`
runs a ThreadingHTTPServer of `handler` on a free port from a thread and yields its base URL and port;
`Quiet` is a request handler that logs nothing and answers with `send_body`."""
from __future__ import annotations

import contextlib
import http.server
import threading
from typing import Iterator, Optional


class Quiet(http.server.BaseHTTPRequestHandler):
    def send_body(self, body: bytes, status: int = 200, content_type: Optional[str] = None) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[tuple[str, int]]:
    """(base URL, port) of a server of `handler` on 127.0.0.1, shut down and closed on exit."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", server.server_port
    finally:
        server.shutdown()
        server.server_close()
