"""A real `omnifeed serve` process for tests: write its config, start it, wait for its socket, kill or stop it."""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from omnifeed.loader import FeedConfig, PlanConfig
from omnifeed.loader.service._config import ServiceConfig
from omnifeed.loader.service._protocol import wait_until_serving
from omnifeed.loader.service._server import FeedService

_SERVE = "from omnifeed.tools._cli import main; raise SystemExit(main())"


def short_socket_dir() -> Path:
    """A fresh private directory under /tmp (socket paths must stay under 108 bytes), removed when the tests end."""
    folder = Path(tempfile.mkdtemp(prefix="of-sock-", dir="/tmp"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # a test's service may use it until the session ends
    return folder


def write_config(
    folder: Path,
    index: Path,
    *,
    socket: Path,
    audit_log: Path | None = None,
    feed: dict[str, Any] | None = None,
    **extra: Any,
) -> Path:
    """A service YAML config for ``index`` (``feed`` default: plan seed 3, batch size 4, as the feed tests use)."""
    config: dict[str, Any] = {
        "index": str(index),
        "socket": str(socket),
        "feed": feed or {"plan": {"seed": 3, "batch_size": 4}},
        **extra,
    }
    if audit_log is not None:
        config["audit_log"] = str(audit_log)
    path = folder / "service.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


class ServiceProcess:
    """`omnifeed serve --config CONFIG [ARGS...]` in a subprocess."""

    def __init__(self, config: Path, socket: Path, args: tuple[str, ...] = ()) -> None:
        self.config, self.socket, self.args = config, socket, args
        self.process: subprocess.Popen[str] | None = None
        # What it prints goes to a file, not a pipe: a service that serves many tests must never block on a full pipe.
        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")
        fcntl.fcntl(self._log.fileno(), fcntl.F_SETFL, fcntl.fcntl(self._log.fileno(), fcntl.F_GETFL) | os.O_APPEND)

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        """Start and wait until the service answers a metrics request."""
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVE, "serve", "--config", str(self.config), *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_until_serving(str(self.socket), self.process, timeout, detail=self.output)
        return self

    @property
    def pid(self) -> int:
        """The service's process id."""
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM; the exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=30)

    def output(self) -> str:
        """What the service printed (every start of this object, in order)."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()


def start_service(index_dir: Path, socket: Path, audit: Path) -> FeedService:
    """The feed service in this process (what `omnifeed serve` runs), plan seed 3, batch size 4, auditing to
    ``audit``."""
    config = ServiceConfig(
        index=str(index_dir),
        feed=FeedConfig(plan=PlanConfig(seed=3, batch_size=4)),
        socket=str(socket),
        audit_log=str(audit),
    )
    service = FeedService(config)
    service.start()
    return service
