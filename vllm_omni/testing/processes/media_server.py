"""A local HTTP server on 127.0.0.1 that serves fixed answers, for the tests of input images by URL (media.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = tuple[int, Mapping[str, str], bytes]
"""An answer: its status, headers and body; ``{port}`` in a header is this server's port (a redirect to
``http://localhost:{port}/x``)."""


@contextlib.contextmanager
def serve_answers(answers: Mapping[str, Answer]) -> Iterator[str]:
    """Serve ``answers`` by path (any other path: 404) on 127.0.0.1 until the block ends; yields the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, headers, body = answers.get(self.path, (404, {}, b"no such file"))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value.replace("{port}", str(port)))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
