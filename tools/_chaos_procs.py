"""The processes of `omnifeed chaos`: the feed service, the toy training job, and finding what they leave behind.

Every process the soak starts carries ``OMNIFEED_CHAOS_RUN=<token>`` in its environment, and
so does everything they start (decode worker processes fork from a server the service
starts), so `marked_processes` finds every descendant of the soak, even one whose parent
died, without mistaking another job's processes for ours.

The training job is what an elastic agent (torchrun) would run: ``world_size`` toy trainer
ranks (``omnifeed.trainer_adapter --torchrun``, DDP over gloo), started
together with torchrun's environment variables, stopped together (SIGTERM, then SIGKILL)
when one of them dies or the world size changes, and restarted from the last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from omnifeed.loader.service import wait_until_serving

MARKER = "OMNIFEED_CHAOS_RUN"
_GRACE_S = 5.0


def marked_processes(token: str) -> list[psutil.Process]:
    """Live processes of this user whose environment carries ``MARKER=token`` (this process excluded)."""
    found = []
    for process in psutil.process_iter(["pid", "uids"]):
        if process.pid == os.getpid() or process.info["uids"] is None or process.info["uids"].real != os.getuid():
            continue
        try:
            if process.environ().get(MARKER) == token and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def reap_orphans(token: str) -> list[str]:
    """Processes of the run ``token`` still alive after everything stopped (reported, then killed)."""
    deadline = time.monotonic() + 10
    left = marked_processes(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = marked_processes(token)
    found = []
    for process in left:
        try:
            found.append(f"pid {process.pid} ({' '.join(process.cmdline())[:100]})")
            process.kill()
        except Exception:  # noqa: BLE001  gone meanwhile
            pass
    return found


def describe(process: psutil.Process) -> str:
    """``pid 123 (python -m omnifeed.tools serve ...)``, for reports."""
    try:
        command = " ".join(process.cmdline())[:120]
    except psutil.Error:
        command = "?"
    return f"pid {process.pid} ({command})"


def _environment(token: str, **extra: str) -> dict[str, str]:
    return {**os.environ, MARKER: token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Service:
    """`omnifeed serve --config CONFIG` in a subprocess, restarted after each kill; output appended to ``log``."""

    def __init__(self, config: Path, socket_path: Path, log: Path, token: str) -> None:
        self.config, self.socket, self.log, self.token = config, socket_path, log, token
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout: float = 60.0) -> None:
        """Start and wait until the service answers a metrics request."""
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process (it listens a few seconds later)."""
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "omnifeed.tools", "serve", "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_environment(self.token),
            )
        self.starts += 1

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the service answers a metrics request."""
        assert self.process is not None
        wait_until_serving(str(self.socket), self.process, timeout, detail=lambda: f"see {self.log}")

    @property
    def pid(self) -> int:
        """The running service's process id."""
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        """Whether the service process is running."""
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> int | None:
        """SIGTERM (SIGKILL after 60 s); the exit status, None if it was not running."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
                return None
        return self.process.returncode

    def decode_workers(self) -> list[psutil.Process]:
        """The service's worker processes: children of its multiprocessing fork server — its streams' producer
        processes (``producers: processes``) and decode worker processes (``executor: processes``) alike."""
        try:
            tree = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []
        servers = {p.pid for p in tree if _parent(p) == self.pid and _cmdline_has(p, "forkserver")}
        return [p for p in tree if _parent(p) in servers]

    def resources(self) -> dict[str, Any] | None:
        """RSS (bytes), open descriptors and threads of the service, and of its child processes."""
        try:
            main = psutil.Process(self.pid)
            with main.oneshot():
                row = {"rss": main.memory_info().rss, "fds": main.num_fds(), "threads": main.num_threads()}
            children = main.children(recursive=True)
            row["children"] = len(children)
            row["children_rss"] = sum(_rss(c) for c in children)
            return row
        except psutil.Error:
            return None


def _cmdline_has(process: psutil.Process, word: str) -> bool:
    try:
        return any(word in part for part in process.cmdline())
    except psutil.Error:
        return False


def _parent(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:
        return None


def _rss(process: psutil.Process) -> int:
    try:
        return int(process.memory_info().rss)
    except psutil.Error:
        return 0


class Job:
    """``world_size`` toy trainer ranks started together from ``checkpoint``, as torchrun starts its workers."""

    def __init__(
        self,
        number: int,
        world_size: int,
        address: Path,
        checkpoint: Path,
        folder: Path,
        token: str,
        save_every: int,
        stop_file: Path,
    ) -> None:
        self.number, self.world_size = number, world_size
        self.folder = folder / f"job-{number:03d}-w{world_size}"
        self.folder.mkdir(parents=True, exist_ok=True)
        port = str(_free_port())
        self.ranks: list[subprocess.Popen[bytes]] = []
        self.killed: set[int] = set()
        for rank in range(world_size):
            environment = _environment(
                token,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE=str(world_size),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
            )
            command = [
                sys.executable,
                "-m",
                "omnifeed.trainer_adapter",
                "--torchrun",
                "--address",
                str(address),
                "--checkpoint",
                str(checkpoint),
                "--save-every",
                str(save_every),
                "--save-at-end",
                "--epochs",
                "1000000",
                "--stop-file",
                str(stop_file),
            ]
            with (
                open(self.folder / f"rank-{rank}.out", "wb") as out,
                open(self.folder / f"rank-{rank}.err", "wb") as err,
            ):
                self.ranks.append(subprocess.Popen(command, stdout=out, stderr=err, env=environment))

    def status(self) -> str:
        """``running``, ``finished`` (every rank exited 0: asked to stop, it finished its epoch) or ``failed``."""
        codes = [p.poll() for p in self.ranks]
        if any(code not in (None, 0) for code in codes):
            return "failed"
        return "finished" if all(code == 0 for code in codes) else "running"

    def kill_rank(self, rank: int) -> None:
        """SIGKILL one rank (fault injection)."""
        self.killed.add(rank)
        self.ranks[rank].kill()

    def stop(self) -> None:
        """Stop every rank as torchrun does when a worker fails or the membership changes: SIGTERM, then SIGKILL."""
        for process in self.ranks:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for process in self.ranks:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)

    def failures(self) -> list[str]:
        """Ranks that exited non-zero and were not killed on purpose, each with the end of its stderr."""
        found = []
        for rank, process in enumerate(self.ranks):
            code = process.poll()
            if code not in (None, 0) and rank not in self.killed and code != -signal.SIGTERM:
                tail = (self.folder / f"rank-{rank}.err").read_text(errors="replace").strip().splitlines()[-3:]
                found.append(f"job {self.number} rank {rank} exited {code}: {' | '.join(tail)}")
        return found

    def summaries(self) -> list[dict[str, Any]]:
        """The ranks' JSON summary lines (ranks that finished)."""
        out = []
        for rank in range(self.world_size):
            lines = (self.folder / f"rank-{rank}.out").read_text(errors="replace").splitlines()
            out += [json.loads(line) for line in lines if line.startswith("{")]
        return out
