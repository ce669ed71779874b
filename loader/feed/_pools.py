"""Per-modality decode pools: task queues, dedicated and shared worker threads, bounded ready buffers.

One ``DecodePools`` holds the worker threads; each pipeline that uses it takes an owner handle
(``pools.owner(on_error)``) with its own budget. Several pipelines (one per data-parallel rank a
sidecar serves) can share one set of workers this way::

    DecodePools(config) ── workers: dedicated per modality + shared ──┐
       ├─ owner A: admit ─▶ submit ─▶ (decoded) ─▶ release        │ round robin over owners,
       └─ owner B: admit ─▶ submit ─▶ (decoded) ─▶ release        │ per modality
    owner.close(): drops its queued tasks, waits for its running ones; the workers keep serving the others
    pools.close(): closes every owner, stops the workers and joins them (idempotent)

Each owner has, per modality, its own budget of samples (and bytes) admitted ahead of its consumer.
A micro-batch is admitted only when every modality it needs has room, except that a modality with
nothing outstanding always admits (so a micro-batch larger than a buffer cannot deadlock). An
owner whose consumer is slow therefore holds at most its own budget of queued work.

Planned, not guessed: each task carries when its consumer will need it (``due``: the planned
cost of its owner's micro-batches before its own; the plan knows every micro-batch's cost), and
each owner counts the cost its consumer has taken (``consumed``). A worker takes the task with
the smallest lead (``due - consumed``: the cost its consumer still has ahead of it), whichever
owner's: workers go to the rank that needs its next micro-batch soonest, and within a rank to the
micro-batch at the head of its queue (a micro-batch is only as ready as its slowest field). A
slow consumer's owner is served once the others are as far ahead, so it is never starved. Among
tasks of equal lead, a shared worker takes the modality whose queued work takes longest to clear
at its measured decode time per task (an exponential moving average) and its dedicated workers,
so workers move to the modality that is running dry. A task's exception goes to its own owner's
``on_error``.

Threads by default: Pillow and PyAV release the GIL while decoding and resizing (two image
threads decode 2× one thread), and threads share the index, the plan and the decoded tensors
without copies. A modality can decode in worker processes instead (``PoolConfig.executor: processes``;
the threads then hand tasks over and wait): the processes write decoded arrays into shared
memory and the pipe carries headers (``decode/_scratch``), so the decode leaves this GIL.
With ``executor: ray`` (`_remote`), a modality also has one thread per remote slot of its Ray actors
(with ``workers: 0``, only those):
it takes tasks like a local worker, but only while its actor is up, and runs each with its
``RemoteSlot`` (a local worker runs a task with None: decode here).

``shared_workers: cpus`` keeps one shared worker taking tasks for each CPU the process may run on
now (its affinity, read before each task; the others wait, and more start when it may run on more
than ever before): a service's producer
process is moved between CPU windows as streams come and go, and on a window of one CPU a
second decode thread only takes turns with the first at the interpreter lock, at a cost in CPU
a batch (benchmarks/RESULTS.md, "Producers' decode threads").
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._modalities import FIELD_MODALITIES
from ._config import FeedConfig, PoolConfig
from ._process_memory import follow_numpy_hugepages

if TYPE_CHECKING:
    from ._remote import RemoteDecoders
    from ._remote_state import RemoteSlot

Task = Callable[["RemoteSlot | None"], int]
"""A unit of work: fetch and decode one field (on the remote slot given; None: here), store it, return its bytes."""


_PARKED_S = 1.0
"""How often a shared worker waiting beyond the CPUs (``shared_workers: cpus``) looks again; a working one wakes it
sooner when it sees more CPUs."""


def _cpus() -> int:
    """The CPUs the calling thread may run on."""
    return len(os.sched_getaffinity(0))


class PoolOwner:
    """One pipeline's share of a ``DecodePools``: its budget, its queued tasks, its error handler.

    ``read_ahead`` multiplies the sample budget (raised while origin storage is degraded).
    """

    def __init__(
        self, pools: DecodePools, on_error: Callable[[BaseException], None], limits: Mapping[str, PoolConfig]
    ) -> None:
        self._pools = pools
        self._on_error = on_error
        self._limits = dict(limits)
        self._room_freed = threading.Condition(pools._lock)  # admit waits here for this owner's releases
        self._idle = threading.Condition(pools._lock)  # close waits here for this owner's running tasks
        self._queues: dict[str, deque[tuple[float, Task]]] = {m: deque() for m in FIELD_MODALITIES}  # (due, task)
        self._outstanding = dict.fromkeys(FIELD_MODALITIES, 0)  # admitted, not yet released
        self._ready = dict.fromkeys(FIELD_MODALITIES, 0)  # decoded, not yet released
        self._ready_bytes = dict.fromkeys(FIELD_MODALITIES, 0)
        self._running = 0  # tasks of this owner in a worker now
        self._consumed = 0.0  # planned cost its consumer has taken
        self.closed = False
        self.read_ahead = 1

    def admit(self, needs: Mapping[str, int], stopping: threading.Event) -> bool:
        """Wait until every modality in ``needs`` has room; reserve it. False if stopping or closed first."""
        with self._room_freed:
            while not (self.closed or stopping.is_set() or all(self._room(m, n) for m, n in needs.items() if n)):
                self._room_freed.wait(0.1)
            if self.closed or stopping.is_set():
                return False
            for modality, n in needs.items():
                self._outstanding[modality] += n
            return True

    def _room(self, modality: str, n: int) -> bool:
        limit = self._limits[modality]
        if self._outstanding[modality] == 0:
            return True
        # Deeper read-ahead admits more samples, never more decoded bytes than the budget.
        samples = limit.buffer_samples * self.read_ahead
        return self._outstanding[modality] + n <= samples and self._ready_bytes[modality] < limit.buffer_bytes

    def submit(self, modality: str, task: Task, due: float = 0.0) -> None:
        """Queue one admitted task of ``modality`` whose consumer needs it once it has taken ``due`` of planned cost
        (dropped once this owner is closed); an owner's tasks of a modality run in order of ``due``."""
        self._pools._submit(self, modality, task, due)

    def consumed(self, cost: float) -> None:
        """The consumer took a micro-batch of planned ``cost``: this owner's queued tasks are that much nearer."""
        with self._room_freed:
            self._consumed += cost

    def release(self, modality: str, count: int, nbytes: int) -> None:
        """The consumer is done with ``count`` decoded fields (``nbytes``) of ``modality``."""
        with self._room_freed:
            self._outstanding[modality] -= count
            self._ready[modality] -= count
            self._ready_bytes[modality] -= nbytes
            self._room_freed.notify_all()

    def buffers(self) -> dict[str, dict[str, Any]]:
        """Per modality: decoded samples waiting for the consumer, their bytes, and queued work."""
        with self._room_freed:
            return {
                m: {
                    "buffer_samples": self._ready[m],
                    "buffer_bytes": self._ready_bytes[m],
                    "queued": len(self._queues[m]),
                }
                for m in FIELD_MODALITIES
                if self._outstanding[m] or self._ready[m] or self._queues[m]
            }

    def close(self) -> None:
        """Drop this owner's queued tasks and wait for its running ones; other owners go on (idempotent)."""
        self._pools._close_owner(self)

    def __enter__(self) -> PoolOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DecodePools:
    """Worker threads per modality plus shared ones, serving the tasks of one or more owners.

    ``config`` sets the workers (``PoolConfig.threads``, ``shared_workers``) and each owner's
    default buffers (``buffer_samples``, ``buffer_bytes``). ``on_error``, if given, is also told
    of every task's exception, whichever owner's (after that owner's own ``on_error``): a log hook.
    """

    def __init__(
        self,
        config: FeedConfig,
        on_error: Callable[[BaseException], None] | None = None,
        remote: RemoteDecoders | None = None,
    ) -> None:
        self._observe = on_error
        follow_numpy_hugepages(config.numpy_hugepages)  # the decode threads' arrays, and the batches collated here
        # One lock; separate conditions so that a finished or submitted task wakes only the
        # threads that can act on it (a notify_all per task woke every worker: GIL churn).
        self._lock = threading.Lock()
        self._work_ready = {m: threading.Condition(self._lock) for m in FIELD_MODALITIES}
        self._shared_work = threading.Condition(self._lock)
        self._limits = {m: config.pool(m) for m in FIELD_MODALITIES}
        self._turns: dict[str, deque[PoolOwner]] = {m: deque() for m in FIELD_MODALITIES}  # owners with queued tasks
        self._queued = dict.fromkeys(FIELD_MODALITIES, 0)  # over all owners
        self._seconds_per_task = dict.fromkeys(FIELD_MODALITIES, 0.0)  # measured, moving average
        self._owners: list[PoolOwner] = []
        self._closed = False
        self._threads: list[threading.Thread] = []
        # shared_workers "cpus": one a CPU this process may run on now; those beyond the CPUs it may run on later wait
        self._follow_cpus = config.shared_workers == "cpus"
        shared = _cpus() if config.shared_workers == "cpus" else config.shared_workers
        self._allowed = self._shared = shared  # shared workers that take tasks (the others wait in `_parked`); started
        self._parked = threading.Condition(self._lock)
        for modality in FIELD_MODALITIES:
            for i in range(self._limits[modality].threads):
                self._start(f"omnifeed-{modality}-{i}", (modality,))
        for i in range(shared):
            self._start(f"omnifeed-shared-{i}", None, i)
        served = {m for m in FIELD_MODALITIES if self._limits[m].threads or self._limits[m].executor == "ray"} | (
            set(FIELD_MODALITIES) if shared else set()
        )
        self._inline = set(FIELD_MODALITIES) - served  # no worker would ever run these: run at submit
        if remote is not None:
            remote.attach(self._queued.__getitem__)  # read without the lock: a hint for scaling
            for modality, slots in remote.slots().items():
                for slot in range(slots):
                    thread = threading.Thread(
                        target=self._work_remote,
                        args=(remote, modality, slot),
                        name=f"omnifeed-{modality}-remote-{slot}",
                        daemon=True,
                    )
                    thread.start()
                    self._threads.append(thread)

    def _start(self, name: str, modalities: tuple[str, ...] | None, number: int = 0) -> None:
        thread = threading.Thread(target=self._work, args=(modalities, number), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def owner(self, on_error: Callable[[BaseException], None], config: FeedConfig | None = None) -> PoolOwner:
        """A new owner whose tasks' exceptions go to ``on_error``, with the buffers of ``config``
        (default: this pools' config; its worker counts are ignored). Raises RuntimeError once closed."""
        limits = self._limits if config is None else {m: config.pool(m) for m in FIELD_MODALITIES}
        with self._lock:
            if self._closed:
                raise RuntimeError("the decode pools are closed")
            owner = PoolOwner(self, on_error, limits)
            self._owners.append(owner)
            return owner

    def _submit(self, owner: PoolOwner, modality: str, task: Task, due: float) -> None:
        if modality in self._inline:
            with self._lock:
                if owner.closed:
                    return
                owner._running += 1
            self._run(owner, modality, task, None)
            return
        with self._lock:
            if owner.closed:
                return
            queue = owner._queues[modality]
            if not queue:
                self._turns[modality].append(owner)
            if queue and queue[-1][0] > due:  # a read that finished late: in order of due all the same
                bisect.insort(queue, (due, task), key=lambda queued: queued[0])
            else:
                queue.append((due, task))
            self._queued[modality] += 1
            self._work_ready[modality].notify()
            self._shared_work.notify()

    def _pick(self, modalities: tuple[str, ...] | None) -> tuple[PoolOwner, str, Task] | None:
        """The queued task needed soonest (smallest lead) among ``modalities`` (None: all, for a shared worker: ties
        go to the longest backlog in seconds of work per worker), and its owner (holding the lock)."""
        best: tuple[float, tuple[float, float], PoolOwner, str] | None = None
        for modality in modalities or FIELD_MODALITIES:
            if not self._queued[modality]:
                continue
            backlog = self._backlog_seconds(modality) if modalities is None else (0.0, 0.0)
            tie = (-backlog[0], -backlog[1])
            for owner in self._turns[modality]:  # in turn: of equal leads, the owner served longest ago
                lead = owner._queues[modality][0][0] - owner._consumed
                if best is None or (lead, tie) < (best[0], best[1]):
                    best = (lead, tie, owner, modality)
        if best is None:
            return None
        _, _, owner, modality = best
        turns = self._turns[modality]
        turns.remove(owner)
        queue = owner._queues[modality]
        _, task = queue.popleft()
        if queue:
            turns.append(owner)
        self._queued[modality] -= 1
        owner._running += 1
        return owner, modality, task

    def _backlog_seconds(self, modality: str) -> tuple[float, float]:
        per_task = self._seconds_per_task[modality] or 1e-3  # unmeasured yet: assume cheap
        backlog = self._queued[modality] * per_task / (self._limits[modality].threads + 1)
        ready = sum(owner._ready[modality] for owner in self._owners)
        return backlog, -ready / (self._limits[modality].buffer_samples * max(1, len(self._owners)))

    def _work(self, modalities: tuple[str, ...] | None, number: int = 0) -> None:
        """A worker's loop (``modalities`` None: a shared one, ``number`` of them, which counts against the CPUs)."""
        wakeup = self._shared_work if modalities is None else self._work_ready[modalities[0]]
        follow = self._follow_cpus and modalities is None
        while True:
            with self._lock:
                while True:
                    if follow:
                        self._wait_for_a_cpu(number)
                    picked = self._pick(modalities)
                    if picked is not None or self._closed:
                        break
                    wakeup.wait(0.5)
                if picked is None:
                    return
            self._run(*picked, None)

    def _wait_for_a_cpu(self, number: int) -> None:
        """Shared worker ``number`` waits while this process may run on no more CPUs than that (holding the lock);
        one that sees more CPUs than before wakes those waiting, and starts workers for CPUs none had yet."""
        allowed = _cpus()  # this thread's affinity: a service places every thread of its producer alike
        if allowed > self._allowed and not self._closed:
            self._parked.notify_all()
            for more in range(self._shared, allowed):  # they inherit this thread's CPUs
                self._start(f"omnifeed-shared-{more}", None, more)
            self._shared = max(self._shared, allowed)
        self._allowed = allowed
        while number >= self._allowed and not self._closed:
            self._parked.wait(_PARKED_S)
            self._allowed = _cpus()

    def _work_remote(self, remote: RemoteDecoders, modality: str, slot: int) -> None:
        """A remote slot: takes the modality's tasks only while its Ray actor is up, and runs them there."""
        while not self._closed:
            if not remote.wait_slot(modality, slot, 0.5):
                continue
            with self._lock:
                picked = self._pick((modality,))
                if picked is None and not self._closed:
                    self._work_ready[modality].wait(0.5)
                    picked = self._pick((modality,))
            if picked is not None:
                self._run(*picked, remote.slot(modality, slot))

    def _run(self, owner: PoolOwner, modality: str, task: Task, remote: RemoteSlot | None) -> None:
        started = time.perf_counter()
        try:
            nbytes = task(remote)
        except BaseException as exc:  # noqa: BLE001  reported to the owner's consumer, who re-raises it
            owner._on_error(exc)
            if self._observe is not None:
                self._observe(exc)
            nbytes = 0
        seconds = time.perf_counter() - started
        with self._lock:
            if modality not in self._inline:
                previous = self._seconds_per_task[modality]
                self._seconds_per_task[modality] = seconds if not previous else 0.8 * previous + 0.2 * seconds
            owner._ready[modality] += 1
            owner._ready_bytes[modality] += nbytes  # only shrinks room: nobody to wake
            owner._running -= 1
            if owner._running == 0:
                owner._idle.notify_all()

    def buffers(self) -> dict[str, dict[str, Any]]:
        """Per modality, summed over the owners: decoded samples waiting, their bytes, and queued work."""
        with self._lock:
            owners = list(self._owners)
        total: dict[str, dict[str, Any]] = {}
        for owner in owners:
            for modality, counts in owner.buffers().items():
                into = total.setdefault(modality, dict.fromkeys(counts, 0))
                for name, value in counts.items():
                    into[name] += value
        return total

    def _close_owner(self, owner: PoolOwner) -> None:
        with self._lock:
            if not owner.closed:
                owner.closed = True
                for modality, queue in owner._queues.items():
                    if queue:
                        self._queued[modality] -= len(queue)
                        self._turns[modality].remove(owner)
                        queue.clear()
                self._owners.remove(owner)
                owner._room_freed.notify_all()
            # A task may close its own owner: never wait for it from a worker thread.
            if threading.current_thread() not in self._threads:
                while owner._running:
                    owner._idle.wait(0.5)

    def close(self) -> None:
        """Close every owner (queued tasks are dropped), stop every worker and wait for them (idempotent).

        An owner still open is told through its ``on_error`` (a RuntimeError), so its consumer stops waiting.
        """
        with self._lock:
            self._closed = True
            owners = list(self._owners)
        for owner in owners:
            self._close_owner(owner)
            owner._on_error(RuntimeError("the decode pools were closed under this pipeline"))
        with self._lock:
            self._shared_work.notify_all()
            self._parked.notify_all()
            for condition in self._work_ready.values():
                condition.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._threads.clear()

    def __enter__(self) -> DecodePools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
