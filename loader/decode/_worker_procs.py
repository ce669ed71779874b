"""Decode worker processes, one pipe each: a worker that dies costs a retry, never a hang, a lost pool or an orphan.

Modalities configured with ``PoolConfig.processes`` decode here. A pool thread that has a
field to decode takes a free worker, sends it the call on the worker's own pipe and waits for
the answer or the worker's death::

    thread ──take an idle worker (start one if fewer than `processes` run)──▶ send (function, args)
           ◀── ("ok", value) | ("error", exception) ── wait(pipe, process sentinel)
           worker gone (killed, out of memory, crashed): EOF or sentinel → a new worker, one more try;
           dead twice on the same call → `WorkerDied` (the field is failed and replaced by the feed)

Why not ``concurrent.futures.ProcessPoolExecutor`` (``omnifeed chaos`` kills decode workers,
and found all three): one killed worker breaks the whole executor for good (every later task
raises ``BrokenProcessPool``); a worker killed while it writes a large result leaves half a
message in the shared result pipe and the executor's manager thread waits for the rest forever
(the modality stalls and shutdown hangs); and its workers keep the write end of their own task
queue, so they never see their parent die: a ``kill -9`` of the service left the workers, the
fork server and the resource tracker running. Here each worker's pipe has one writer at each
end: a dead parent is an EOF for the worker, which then exits; a dead worker is an EOF (or its
sentinel) for the waiting thread.

With ``scratch_bytes``, each worker also shares a scratch area with the parent (`_scratch`): the
arrays of a result are written there and the pipe carries only their headers; the parent gets
numpy views, and a view's memory is reused once no array uses it any more. A dead worker's area
lives on in the parent while views of it do, and vanishes with the last of them.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from multiprocessing import popen_forkserver
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext, ForkServerProcess
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._scratch import ScratchArena, WorkerScratch

log = logging.getLogger(__name__)

_JOIN_S = 2.0
_LEAN_UNTIL = (3, 14)  # `_LeanPopen._launch` follows the fork server of 3.8–3.13; later ones start workers as usual


class WorkerDied(RuntimeError):
    """A decode worker process died while it held the call (killed, out of memory, or crashed on the input)."""


def _serve(conn: Connection, scratch: WorkerScratch | None) -> None:
    """A worker's loop: run calls from the pipe until the parent closes it (or dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    while True:
        try:
            function, args = conn.recv()
            block = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, Any] = ("ok", function(*args))
        except BaseException as exc:  # noqa: BLE001  re-raised in the calling thread (an OSError included)
            reply = ("error", exc)
        if reply[0] == "ok" and scratch is not None and block is not None:
            try:
                reply = _placed(conn, scratch, reply[1], block)
            except (EOFError, OSError):  # the pipe: the parent is gone
                return
            except Exception as exc:  # noqa: BLE001  re-raised in the calling thread
                reply = ("error", exc)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001  the value or the exception does not pickle
            conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))


def _placed(conn: Connection, scratch: WorkerScratch, value: Any, block: tuple[int, int]) -> tuple[str, Any]:
    """("placed", (skeleton, specs)) once ``value``'s arrays are in the scratch area, else ("ok", value) for the
    pipe."""
    placed = scratch.place(value, block)
    need = scratch.needed(value) if placed is None else 0
    if need:  # ask for a block that fits, once
        conn.send(("need", need))
        block = conn.recv()
        placed = scratch.place(value, block) if block is not None else None
    return ("ok", value) if placed is None else ("placed", placed)


class _LeanPopen(popen_forkserver.Popen):
    """A fork-server start without the parent's ``__main__``: a decode worker runs only omnifeed functions.

    multiprocessing re-runs the main module's top level in every child it starts this way; a training
    script's imports (torch, the model) then cost each decode worker seconds of start and hundreds of MiB.
    The rest is `popen_forkserver.Popen._launch` as of Python 3.8–3.13.
    """

    def _launch(self, process_obj: Any) -> None:
        import io
        import os
        from multiprocessing import forkserver, reduction, spawn, util
        from multiprocessing.context import set_spawning_popen

        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _LeanProcess(ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _LeanPopen:
        return _LeanPopen(process_obj)


def child_process_type(context: BaseContext) -> type[BaseProcess]:
    """The ``Process`` class that starts a child running only omnifeed functions from ``context``: with the fork
    server (Python 3.8–3.13), one that does not re-run the parent's ``__main__``; else the context's own."""
    lean = context.get_start_method() == "forkserver" and sys.version_info < _LEAN_UNTIL
    return _LeanProcess if lean else context.Process  # type: ignore[attr-defined,no-any-return]


class _Worker:
    """One worker process and the parent's end of its pipe (the child's end is closed here after start)."""

    def __init__(self, context: BaseContext, name: str, scratch_bytes: int = 0) -> None:
        self.scratch = ScratchArena(scratch_bytes) if scratch_bytes else None
        parent, child = context.Pipe(duplex=True)
        try:
            handle = self.scratch.handle() if self.scratch is not None else None
            process = child_process_type(context)
            self.process = process(target=_serve, args=(child, handle), name=name, daemon=True)
            self.process.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
            if self.scratch is not None:
                self.scratch.close_fd()  # the worker has its own: the area now lives only in the two mappings
        self.conn = parent

    def call(self, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
        """Run ``function(*args)`` in the worker: ("ok", value) or ("error", exception); `WorkerDied` if it died."""
        message = ForkingPickler.dumps((function, args))  # a value that does not pickle fails here, no block taken
        block = self.scratch.reserve() if self.scratch is not None else None
        try:
            self.conn.send_bytes(message)
            self.conn.send(block)
            reply = self._receive()
            if reply[0] == "need" and self.scratch is not None and block is not None:  # larger than its block
                self.scratch.cancel(block)  # untouched: the worker asks before writing
                block = self.scratch.reserve(reply[1])
                self.conn.send(block)
                reply = self._receive()
        except (EOFError, OSError) as exc:
            self.process.join(_JOIN_S)
            if block is not None and self.scratch is not None and not self.process.is_alive():
                self.scratch.cancel(block)
            raise WorkerDied(
                f"decode worker process {self.process.pid} died (exit code {self.process.exitcode})"
            ) from exc
        except WorkerDied:
            if block is not None and self.scratch is not None:
                self.scratch.cancel(block)
            raise
        return self._adopted(reply, block)

    def _receive(self) -> tuple[str, Any]:
        ready = wait([self.conn, self.process.sentinel])
        if self.conn not in ready:
            raise WorkerDied(f"decode worker process {self.process.pid} exited with {self.process.exitcode}")
        reply: tuple[str, Any] = self.conn.recv()  # EOF mid-message when it died writing: nothing else writes here
        return reply

    def _adopted(self, reply: tuple[str, Any], block: tuple[int, int] | None) -> tuple[str, Any]:
        if self.scratch is None or block is None:
            return reply
        status, value = reply
        if status == "placed":
            return "ok", self.scratch.adopt(block, *value)
        self.scratch.cancel(block)
        return reply

    def stop(self) -> None:
        """Close the pipe (the worker exits on EOF) and reap it; kill it if it does not go."""
        self.conn.close()
        self.process.join(_JOIN_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(_JOIN_S)


class WorkerProcesses:
    """Up to ``processes`` worker processes of one modality, started on first use; `run` blocks the calling thread.

    ``restarts`` counts workers lost and replaced. ``close()`` stops every worker (idempotent).
    """

    def __init__(
        self, processes: int, context: BaseContext, name: str = "omnifeed-decode", scratch_bytes: int = 0
    ) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.processes, self.name, self.scratch_bytes = processes, name, scratch_bytes
        self._context = context
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._running = 0  # workers started and not lost (idle or busy)
        self._closed = False
        self.restarts = 0

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` in a worker process (both must pickle); its exception is raised here.

        A worker that dies during the call is replaced and the call made once more; raises
        `WorkerDied` when the second worker dies too, ``CancelledError`` once closed.
        """
        for attempt in (0, 1):
            worker = self._take()
            try:
                status, value = worker.call(function, args)
            except WorkerDied:
                self._lost(worker)
                if attempt:
                    raise
                continue
            self._give_back(worker)
            if status == "error":
                raise value
            return value
        raise AssertionError("unreachable")

    def _take(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise CancelledError()
                if self._idle:
                    return self._idle.pop()
                if self._running < self.processes:
                    self._running += 1
                    break
                self._cond.wait()
        try:
            return _Worker(self._context, self.name, self.scratch_bytes)
        except BaseException:
            with self._cond:
                self._running -= 1
                self._cond.notify()
            raise

    def _give_back(self, worker: _Worker) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(worker)
                self._cond.notify()
                return
            self._running -= 1
        worker.stop()

    def _lost(self, worker: _Worker) -> None:
        worker.stop()
        with self._cond:
            self._running -= 1
            self.restarts += 1
            self._cond.notify()
        log.warning(
            "%s: a worker process died (exit code %s); starting another, its call is made once more",
            self.name,
            worker.process.exitcode,
        )

    def close(self) -> None:
        """Stop the idle workers now, busy ones when their call returns; later calls raise ``CancelledError``."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._running -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.stop()
