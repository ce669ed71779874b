"""`BatchesAhead`: a client's next batches received on a thread of their own; the trainer's ``next()`` takes one.

A training loop asks for its next batch after a step that left this process's caches cold; a
request to the service and the decoding of its reply then cost the trainer's thread a few
hundred microseconds (benchmarks/RESULTS.md, "Trainer CPU per batch as a trainer sees it"). This
thread does that while the trainer computes, like torch's DataLoader's pin-memory thread: it
fetches until ``depth`` batches wait, and the trainer's ``take()`` is a queue pop.

The thread starts with the first ``take()`` (asking a client its length starts nothing). While
``paused()`` it fetches nothing and no fetch is in flight, so the owner may use the connection
itself; ``drain()`` also hands back the batches received and not taken (a resize, a resume or
closing: their owner gives them back to the service). An error of a fetch is raised by the
``take()`` that reaches it; fetching starts again with the next ``take()``. The thread holds its
owner's fetch weakly: a client dropped without ``close()`` lets its thread end.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

Item = TypeVar("Item")


class _Failed:
    """A fetch that raised: re-raised by the ``take()`` that reaches it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class BatchesAhead(Generic[Item]):
    """Up to ``depth`` results of ``fetch`` (a bound method, held weakly) received ahead on a thread named ``name``.

    The trainer's side is two C queue operations: an item out, a credit in (each credit lets the thread fetch one
    more); the thread holds ``_fetching`` while it fetches, which is what ``paused()`` takes.
    """

    def __init__(self, fetch: Callable[[], Item], depth: int, name: str) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self._fetch = weakref.WeakMethod(fetch)  # type: ignore[arg-type]
        self._name = name
        self._items: queue.SimpleQueue[Item | _Failed] = queue.SimpleQueue()
        self._credits: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(depth):
            self._credits.put(None)
        self._fetching = threading.Lock()
        self._failure_taken = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.waited_s = 0.0  # time ``take()`` waited for a batch

    def take(self) -> Item:
        """The next batch (waiting for it); starts the thread the first time."""
        if self._thread is None:
            if self._stopped:
                raise RuntimeError("the client is closed")
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        try:
            item = self._items.get_nowait()
        except queue.Empty:
            started = time.perf_counter()
            item = self._items.get()
            self.waited_s += time.perf_counter() - started
        if isinstance(item, _Failed):
            self._failure_taken.set()
            raise item.error
        self._credits.put(None)
        return item

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No fetch runs inside the block (one in flight is waited for); batches received stay for ``take()``."""
        with self._fetching:
            yield

    def drain(self) -> list[Item]:
        """The batches received and not taken, taken out (an error among them is dropped); call inside ``paused()``."""
        items: list[Item] = []
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                return items
            if isinstance(item, _Failed):
                self._failure_taken.set()
            else:
                items.append(item)
                self._credits.put(None)

    def stop(self) -> None:
        """End the thread (a fetch in flight finishes first); a ``take()`` waiting, or later, says the client is
        closed."""
        self._stopped = True
        self._credits.put(None)
        self._failure_taken.set()
        self._items.put(_Failed(RuntimeError("the client is closed")))

    def _run(self) -> None:
        while True:
            self._credits.get()
            with self._fetching:
                fetch = self._fetch()
                if self._stopped or fetch is None:
                    return
                try:
                    item: Item | _Failed = fetch()
                except BaseException as exc:  # noqa: BLE001  raised in the trainer's thread by take()
                    item = _Failed(exc)
                del fetch  # its owner may go while this thread waits
                if self._stopped:
                    return
                self._items.put(item)
            failed = isinstance(item, _Failed)
            del item  # the queue holds it now
            if failed:  # fetch nothing more until the trainer has seen the error
                self._failure_taken.wait()
                self._failure_taken.clear()
                self._credits.put(None)  # the failed fetch's credit
