"""A real HTTP server over a folder with Range support and injectable latency and errors (for storage tests)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class RangeServer:
    """Serves ``root`` on 127.0.0.1; set ``delay_s`` / ``fail_fraction`` / ``down`` while it runs.

    ``allow``: after that many ranged reads (``served``) the next ones wait (``waiting``) until
    `reset`; a reset drops the waiting ones, so a killed client's reads never count.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.delay_s = 0.0
        self.fail_fraction = 0.0
        self.down = False
        self.allow: int | None = None
        self.requests = self.failures = self.served = self.waiting = self.generation = 0
        self._rng = random.Random(0)
        self._lock = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _file(self) -> Path | None:
                path = (server.root / self.path.lstrip("/").split("?")[0]).resolve()
                return path if path.is_file() and server.root.resolve() in path.parents else None

            def _gate(self) -> bool:
                """Hold a ranged read past ``allow``; False when a reset dropped it."""
                ranged = bool(self.headers.get("Range"))
                with server._lock:
                    generation = server.generation
                    while ranged and server.allow is not None and server.served >= server.allow:
                        server.waiting += 1
                        server._lock.wait()
                        server.waiting -= 1
                        if server.generation != generation:
                            self.close_connection = True
                            return False
                    server.served += ranged
                return True

            def _fault(self) -> bool:
                with server._lock:
                    server.requests += 1
                    failing = server.down or server._rng.random() < server.fail_fraction
                    server.failures += failing
                if server.delay_s:
                    time.sleep(server.delay_s)
                if failing:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                return failing

            def do_HEAD(self) -> None:  # noqa: N802
                if not self._gate() or self._fault():
                    return
                path = self._file()
                if path is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(path.stat().st_size))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                if not self._gate() or self._fault():
                    return
                path = self._file()
                if path is None:
                    self.send_error(404)
                    return
                total = path.stat().st_size
                header = self.headers.get("Range")
                start, stop = 0, total
                if header and header.startswith("bytes="):
                    first, _, last = header[6:].partition("-")
                    start = int(first) if first else total - int(last)
                    stop = min(total, int(last) + 1) if first and last else total
                with open(path, "rb") as f:  # only the range: shards are large, requests many
                    f.seek(start)
                    body = f.read(stop - start)
                if header:
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{total}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # clients that give up on a slow reply reset the connection: expected here

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def reset(self, allow: int | None = None, down: bool = False) -> None:
        """New gate and outage settings; counts start again; reads waiting at the gate are dropped."""
        with self._lock:
            self.allow, self.down, self.served, self.requests = allow, down, 0, 0
            self.generation += 1
            self._lock.notify_all()

    def start(self) -> RangeServer:
        """Serve in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Release waiting reads and shut down."""
        self.reset()
        self._httpd.shutdown()
        self._httpd.server_close()

    @contextmanager
    def running(self) -> Iterator[RangeServer]:
        """Serve until the block ends."""
        self.start()
        try:
            yield self
        finally:
            self.stop()
