"""The remote tier: reads from the origin with timeouts, retries with backoff, and a latency monitor."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import fsspec
import numpy as np

from ._config import RemoteTierConfig

log = logging.getLogger(__name__)

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
_TRANSIENT_ERRNOS = {
    errno.EIO,
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def is_transient(exc: BaseException) -> bool:
    """Whether a storage error is worth retrying: connection trouble, time-outs, throttling, server errors.

    fsspec backends raise their client library's errors (aiohttp, botocore, ...), so besides
    the builtin classes this looks at an HTTP ``status`` and at the class names they share.
    A missing file or a permission error is permanent.
    """
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, TRANSIENT_ERRORS):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status in _TRANSIENT_STATUS
    name = type(exc).__name__
    return any(word in name for word in ("Timeout", "Connection", "Disconnected", "Throttl", "SlowDown"))


def is_local(url: str) -> bool:
    """Whether ``url`` names a file on this machine (a plain path or ``file://``)."""
    return "://" not in url or url.startswith(("file://", "local://"))


class LatencyMonitor:
    """Sliding-window latency percentiles of origin reads, and the degraded-storage flag they drive.

    Degraded turns on when the configured percentile of the last ``latency_window`` reads
    exceeds ``degraded_latency_s`` and off when it falls below ``recover_fraction`` of it
    (the gap keeps it from flapping); each change is logged once.
    """

    def __init__(self, config: RemoteTierConfig) -> None:
        self.config = config
        self._window: deque[float] = deque(maxlen=config.latency_window)
        self._lock = threading.Lock()
        self.degraded = False
        self.changes = 0
        self._since_check = 0

    def record(self, seconds: float) -> None:
        """One read attempt took ``seconds`` (a timed-out attempt counts as the timeout)."""
        with self._lock:
            self._window.append(seconds)
            self._since_check += 1
            # a percentile over the window every few reads: cheap, and quick enough to react
            if self._since_check < 8 or len(self._window) < min(16, self.config.latency_window):
                return
            self._since_check = 0
            level = float(np.quantile(np.fromiter(self._window, float), self.config.latency_percentile))
            threshold = self.config.degraded_latency_s
            if not self.degraded and level > threshold:
                self.degraded, self.changes = True, self.changes + 1
                log.warning(
                    "remote storage degraded: p%d read latency %.3f s is over %.3f s (last %d reads); "
                    "reading further ahead",
                    round(100 * self.config.latency_percentile),
                    level,
                    threshold,
                    len(self._window),
                )
            elif self.degraded and level < threshold * self.config.recover_fraction:
                self.degraded, self.changes = False, self.changes + 1
                log.warning(
                    "remote storage recovered: p%d read latency %.3f s",
                    round(100 * self.config.latency_percentile),
                    level,
                )

    def snapshot(self) -> dict[str, Any]:
        """Percentiles of the window and the flag."""
        with self._lock:
            window = np.fromiter(self._window, float)
        p50, p95, p99 = np.quantile(window, [0.5, 0.95, 0.99]) if window.size else (0.0, 0.0, 0.0)
        return {
            "degraded": self.degraded,
            "degraded_changes": self.changes,
            "latency_s": {"p50": float(p50), "p95": float(p95), "p99": float(p99)},
            "window": int(window.size),
        }


class RemoteTier:
    """Origin reads: a ranged read of any fsspec URL, or any reader function, with timeout, retries and monitoring."""

    def __init__(self, config: RemoteTierConfig | None = None) -> None:
        self.config = config or RemoteTierConfig()
        self.monitor = LatencyMonitor(self.config)
        self._attempts: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._stats = {"reads": 0, "bytes": 0, "retries": 0, "timeouts": 0, "errors": 0}

    def read_range(self, url: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``url`` from ``offset``."""

        def reader() -> bytes:
            fs, path = fsspec.core.url_to_fs(url)
            return bytes(fs.cat_file(path, start=offset, end=offset + length))

        return self.read(url, reader)

    def read(self, url: str, reader: Callable[[], bytes]) -> bytes:
        """Run ``reader`` (which reads from ``url``) under the timeout, retrying transient errors (`is_transient`) with
        backoff.

        A local file is read in the calling thread, without the time-out's thread hand-off.

        The last transient error propagates with a note naming the URL and the attempts;
        other errors (a missing file, a permission error) propagate at once.
        """
        config = self.config
        watched = not is_local(url)  # the monitor watches remote storage; local reads would only dilute it
        for attempt in range(config.retries + 1):
            started = time.perf_counter()
            try:
                data = self._attempt(reader) if watched else reader()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if watched:
                    self.monitor.record(time.perf_counter() - started)
                with self._lock:
                    self._stats["timeouts" if isinstance(exc, TimeoutError) else "errors"] += 1
                if attempt == config.retries:
                    if hasattr(exc, "add_note"):  # Python 3.11+
                        exc.add_note(f"reading {url}: gave up after {attempt + 1} attempts (cache.remote.retries)")
                    raise
                with self._lock:
                    self._stats["retries"] += 1
                time.sleep(config.backoff_s * 2**attempt)
                continue
            if watched:
                self.monitor.record(time.perf_counter() - started)
            with self._lock:
                self._stats["reads"] += 1
                self._stats["bytes"] += len(data)
            return data
        raise AssertionError("unreachable")

    def _attempt(self, reader: Callable[[], bytes]) -> bytes:
        timeout = self.config.timeout_s
        if timeout is None:
            return reader()
        with self._lock:
            if self._attempts is None:
                # A stuck read cannot be interrupted: it is abandoned to this pool and the caller retries.
                self._attempts = ThreadPoolExecutor(2 * self.config.io_threads, thread_name_prefix="omnifeed-remote")
            attempts = self._attempts
        future = attempts.submit(reader)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"read attempt took longer than {timeout} s (cache.remote.timeout_s)") from None

    @property
    def degraded(self) -> bool:
        """Whether origin latency is over the threshold now."""
        return self.monitor.degraded

    def stats(self) -> dict[str, Any]:
        """Reads, bytes, retries, timeouts, errors, and the latency window."""
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
        return {**out, **self.monitor.snapshot()}

    def close(self) -> None:
        """Stop the attempt threads, waiting up to the read time-out for reads still running (then abandoning them)."""
        with self._lock:
            attempts, self._attempts = self._attempts, None
        if attempts is None:
            return
        attempts.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + min(self.config.timeout_s or 5.0, 5.0)
        for thread in list(getattr(attempts, "_threads", ())):
            thread.join(max(0.0, deadline - time.monotonic()))
