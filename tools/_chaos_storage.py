"""Origin storage with faults: an HTTP server over a folder with Range support, injected errors and latency.

`omnifeed chaos` serves its dataset from here so that every read goes through the remote tier
(fsspec HTTP, time-outs, retries, the latency monitor); the tests use it as their HTTP origin
(``tests/range_http.py``). Knobs, changed while it runs:

- ``delay_s``: seconds every request waits before its answer (the base latency);
- ``latency_factor``: multiplies ``delay_s`` (a latency spike: `spike` sets it for a while, and until
  some requests were slowed by it);
- ``fail_fraction``: the share of requests answered 503 (drawn from ``random.Random(seed)``);
- ``down``: every request answered 503 (an outage);
- ``allow``: after that many ranged reads (``served``) the next ones wait (``waiting``) until
  `reset`; a reset drops the waiting ones, so a killed client's reads never count.

Counters: ``requests``, ``failures`` (503s sent), ``slowed`` (requests answered during a
spike), ``served``, ``spikes`` (spikes started).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["RangeServer"]


class RangeServer:
    """Serves ``root`` on 127.0.0.1 (``url``); set the fault knobs while it runs (see the module docstring)."""

    def __init__(self, root: Path, *, seed: int = 0) -> None:
        self.root = root
        self.delay_s = 0.0
        self.latency_factor = 1.0
        self.fail_fraction = 0.0
        self.down = False
        self.allow: int | None = None
        self.requests = self.failures = self.served = self.waiting = self.generation = 0
        self.slowed = self.spikes = 0
        self._spike_until = 0.0
        self._spike_left = 0
        self._rng = random.Random(seed)
        self._lock = threading.Condition()
        self._httpd = _Server(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="omnifeed-range-server", daemon=True)

    # -- faults ----------------------------------------------------------------------------
    def spike(self, seconds: float, factor: float = 10.0, at_least: int = 1) -> None:
        """Multiply the latency by ``factor`` for ``seconds``, and on until ``at_least`` requests were slowed."""
        with self._lock:
            self.latency_factor = factor
            self._spike_until = time.monotonic() + seconds
            self._spike_left = at_least
            self.spikes += 1

    def _latency(self) -> tuple[float, bool]:
        """The delay for a request now, and whether it falls in a spike (holding the lock)."""
        if self._spike_until and time.monotonic() >= self._spike_until and self._spike_left <= 0:
            self.latency_factor, self._spike_until = 1.0, 0.0
        spiking = self.latency_factor != 1.0
        if spiking and self.delay_s > 0:
            self.slowed += 1
            self._spike_left -= 1
        return self.delay_s * self.latency_factor, spiking

    def _fault(self) -> tuple[bool, float]:
        """Count a request; whether it fails, and its delay."""
        with self._lock:
            self.requests += 1
            failing = self.down or self._rng.random() < self.fail_fraction
            self.failures += failing
            delay, _ = self._latency()
        return failing, delay

    def _gate(self, ranged: bool) -> bool:
        """Hold a ranged read past ``allow``; False when a reset dropped it."""
        with self._lock:
            generation = self.generation
            while ranged and self.allow is not None and self.served >= self.allow:
                self.waiting += 1
                self._lock.wait()
                self.waiting -= 1
                if self.generation != generation:
                    return False
            self.served += ranged
        return True

    def file(self, url_path: str) -> Path | None:
        """The served file of a request path, or None (outside ``root`` or missing)."""
        path = (self.root / url_path.lstrip("/").split("?")[0]).resolve()
        return path if path.is_file() and self.root.resolve() in path.parents else None

    # -- lifecycle -------------------------------------------------------------------------
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
        """Release waiting reads and shut down (idempotent)."""
        self.reset()
        if self._thread.is_alive():
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


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that give up on a slow reply reset the connection: expected here


def _handler(server: RangeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _faulted(self) -> bool:
            """Gate, delay and maybe fail the request; True when it was answered (or dropped) already."""
            if not server._gate(bool(self.headers.get("Range"))):
                self.close_connection = True
                return True
            failing, delay = server._fault()
            if delay:
                time.sleep(delay)
            if failing:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
            return failing

        def _found(self) -> Path | None:
            """The requested file, or None once a fault or a 404 has been answered."""
            if self._faulted():
                return None
            path = server.file(self.path)
            if path is None:
                self.send_error(404)
            return path

        def do_HEAD(self) -> None:  # noqa: N802
            path = self._found()
            if path is None:
                return
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self) -> None:  # noqa: N802
            path = self._found()
            if path is None:
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

    return Handler
