"""The service's Prometheus endpoint: `start_metrics_server` serves a `ServiceCollector` over HTTP, `MetricsServer`.

Each scrape calls the snapshot function once (`_metrics_collector`; the families are
`METRICS` in `_metric_specs`, documented in docs/service.md). The snapshot function runs on
the HTTP server's threads, concurrently with the service: it must be thread-safe
(``FeedService.metrics()`` takes its own locks).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from ._metrics_collector import ServiceCollector, Snapshot

log = logging.getLogger(__name__)


class MetricsServer:
    """The running metrics endpoint: ``port``, ``url``; ``shutdown()`` (idempotent) stops it and frees the port."""

    def __init__(self, httpd: Any, thread: threading.Thread, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.host: str = httpd.server_address[0]
        self.port: int = int(httpd.server_port)
        self._finalizer = weakref.finalize(self, MetricsServer._stop, httpd, thread)

    @property
    def url(self) -> str:
        """The scrape URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @staticmethod
    def _stop(httpd: Any, thread: threading.Thread) -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5.0)

    def shutdown(self) -> None:
        """Stop serving, close the socket and join the server thread (idempotent)."""
        self._finalizer()

    close = shutdown

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def start_metrics_server(snapshot: Snapshot, port: int, host: str = "127.0.0.1") -> tuple[MetricsServer, int]:
    """Serve ``snapshot()`` as Prometheus metrics on ``http://host:port/metrics`` from a daemon thread.

    Uses its own `CollectorRegistry` (never the global one, so several services or tests in one
    process do not clash). ``port`` 0 picks a free port. Returns the server and the bound port.
    Raises OSError when the address cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(snapshot))
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    server = MetricsServer(httpd, thread, registry)
    log.info("metrics on %s", server.url)
    return server, server.port
