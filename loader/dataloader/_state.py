"""The drop-in loader's state: what an epoch has delivered, as a small JSON-friendly dict.

State keys (``DataLoader.state_dict()``):

- ``format``: ``"omnifeed.dataloader-state/3"`` (``/2`` states, without ``since_snapshot``, load too).
- ``status``: ``"fresh"`` (no epoch started since the state was made: the next ``iter()`` starts one),
  ``"running"`` (mid-epoch: the next ``iter()`` continues it) or ``"finished"`` (the epoch ended).
- ``base_seed``: the epoch's worker base seed (workers seed ``random``, ``torch`` and ``numpy`` from
  ``base_seed + worker_id``); None before an epoch started.
- ``yielded``: batches yielded in the epoch.
- ``sampler``: ``consumed`` — the index sampler's tasks up to which every batch was yielded or raised;
  ``also_yielded`` — later tasks already yielded (only with ``in_order=False``); ``replay`` — how to
  replay the epoch's order, or between epochs the RNG states the next epoch starts from (see
  ``_dataloader_sampling``); ``snapshot`` — a stateful sampler's (and its iterator's) state after task
  ``consumed``, as ``{"sampler": ..., "iterator": ...}``, else None.
- ``workers``: ``count`` (``num_workers`` when saved), ``next`` (the worker whose batch comes next, for
  iterable datasets), ``datasets`` (per worker, or one entry with no workers: the dataset's and its
  iterator's state after that worker's last yielded batch or its end, ``{"dataset": ..., "iterator": ...}``;
  where the dataset object outlives the epoch (no workers, persistent workers) the state it started the
  epoch from until then; None when the dataset has no state or nothing is known), ``ended`` (per
  worker: its iterable dataset is exhausted, also when it ended inside its last, short batch).

- ``since_snapshot``: batches yielded after the step the rest of the state describes. With workers and
  ``snapshot_every_n_steps=n`` other than 1 (torchdata's argument), workers report their dataset states only
  around every n-th batch (never with 0), so a mid-epoch state is the last snapshot and the batches since,
  which a resume fetches again and drops (as torchdata does); else 0.

The state is JSON-serializable whenever the dataset's and sampler's own states are.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

STATE_FORMAT = "omnifeed.dataloader-state/3"
_OLD_FORMAT = "omnifeed.dataloader-state/2"
_KEYS = {"format", "status", "base_seed", "yielded", "sampler", "workers", "since_snapshot"}
_SAMPLER_KEYS = {"consumed", "also_yielded", "replay", "snapshot"}
_WORKER_KEYS = {"count", "next", "datasets", "ended"}
_REPLAY_KEYS = {"seed", "global_rng", "generators", "draws_base_seed", "pulled"}


class WorkerCountError(ValueError, AssertionError):
    """A state that holds each worker's place, loaded with another ``num_workers`` (torchdata raises an
    ``AssertionError`` there, at the next ``iter()``; it is both)."""


@dataclass
class EpochProgress:
    """What one epoch has delivered so far; ``state()`` turns it into the loader state."""

    num_workers: int
    base_seed: int | None = None
    status: str = "running"
    yielded: int = 0
    consumed: int = 0
    also_yielded: set[int] = field(default_factory=set)
    replay: dict[str, Any] | None = None
    snapshot: dict[str, Any] | None = None
    datasets: list[Any] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)
    next_worker: int = 0
    every: int | None = 1  # snapshot_every_n_steps (workers report dataset states around every n-th batch)
    since_snapshot: int = 0  # a loaded state's batches after its snapshot: the resume fetches and drops them
    _pending: dict[int, dict[str, Any] | None] = field(default_factory=dict)  # snapshots of later tasks
    _snap: dict[str, Any] | None = None  # the state at the last snapshot step (periodic snapshots only)

    def __post_init__(self) -> None:
        slots = max(1, self.num_workers)
        self.datasets = self.datasets or [None] * slots
        self.ended = self.ended or [False] * slots

    def dispatched(self, task: int, snapshot: dict[str, Any] | None) -> None:
        """Task ``task`` left the index sampler; ``snapshot`` is the sampler's state after it."""
        if snapshot is not None:
            self._pending[task] = snapshot

    @property
    def periodic(self) -> bool:
        """Whether states are snapshots every ``every`` batches (workers, ``every`` other than 1)."""
        return self.num_workers > 0 and self.every is not None and self.every != 1

    def wants_state(
        self, task: int, *, in_flight: int, in_order: bool, iterable: bool, tasks: int | None = None
    ) -> bool:
        """Whether task ``task``'s worker should report its dataset state: torchdata's rule, the tasks that can be a
        worker's last before a snapshot step, and each worker's last of the epoch (``tasks``: the epoch's count, when
        known), so that the next epoch of persistent workers starts from their exact states; ``in_flight``: the most
        tasks in flight."""
        if not self.periodic or not in_order:
            return True
        every = self.every or 0
        if every == 0:
            return False
        if iterable:  # which batch a task becomes is known only once workers run out: a wider window
            return (self.yielded % every) + 1 + in_flight + self.num_workers >= every
        return task % every + self.num_workers >= every or (tasks is not None and task + self.num_workers >= tasks)

    def delivered(self, task: int, worker: int, dataset_state: Any, *, yielded: bool, ended: bool = False) -> None:
        """Task ``task``'s batch was yielded (or its error raised); ``dataset_state`` is that worker's state after it;
        ``ended``: the worker's iterable dataset ran out while filling this (short) batch."""
        if self.periodic and self._snap is None:  # the epoch's start, or the loaded snapshot
            self._snap = self._state()
        if yielded:
            self.yielded += 1
            if dataset_state is not None:
                self.datasets[worker] = dataset_state
            if ended:
                self.ended[worker] = True
            if self.num_workers:
                self.next_worker = (worker + 1) % self.num_workers
        self._consume(task)
        if yielded and self.periodic and self.every and self.yielded % self.every == 0:
            self._snap = self._state()

    def worker_ended(self, task: int, worker: int, dataset_state: Any = None) -> None:
        """Task ``task`` found ``worker``'s iterable dataset exhausted; ``dataset_state`` is its state then."""
        self.ended[worker] = True
        if dataset_state is not None:
            self.datasets[worker] = dataset_state
        self._consume(task)

    def skipped(self, task: int) -> None:
        """Task ``task`` was dispatched but never served (its worker had ended)."""
        self._consume(task)

    def _consume(self, task: int) -> None:
        if task != self.consumed:
            self.also_yielded.add(task)
            return
        self.consumed += 1
        while self.consumed in self.also_yielded:
            self.also_yielded.discard(self.consumed)
            self.consumed += 1
        last = self.consumed - 1
        if last in self._pending:
            self.snapshot = self._pending[last]
        for done in [t for t in self._pending if t <= last]:
            del self._pending[done]

    def next_epoch_datasets(self) -> list[Any]:
        """The states the next epoch starts from on the same dataset objects: each worker's dataset part
        (a new epoch calls ``iter(dataset)`` afresh, so its iterator's state is left behind)."""
        return [
            {"dataset": s["dataset"], "iterator": None}
            if isinstance(s, Mapping) and s.get("dataset") is not None
            else None
            for s in self.datasets
        ]

    def forget_dispatched(self) -> None:
        """In-flight tasks were dropped (a resize or a restart): only delivered ones count."""
        self._pending.clear()

    def state(self) -> dict[str, Any]:
        """The loader state (a deep copy: later progress never changes it): mid-epoch with periodic snapshots, the
        last snapshot and the batches yielded since."""
        if self.status == "running" and self._snap is not None:
            return {**copy.deepcopy(self._snap), "since_snapshot": self.yielded - self._snap["yielded"]}
        return self._state()

    def _state(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "format": STATE_FORMAT,
                "since_snapshot": 0,
                "status": self.status,
                "base_seed": self.base_seed,
                "yielded": self.yielded,
                "sampler": {
                    "consumed": self.consumed,
                    "also_yielded": sorted(self.also_yielded),
                    "replay": self.replay,
                    "snapshot": self.snapshot,
                },
                "workers": {
                    "count": self.num_workers,
                    "next": self.next_worker,
                    "datasets": list(self.datasets),
                    "ended": list(self.ended),
                },
            }
        )


def _exact_keys(what: str, value: Any, keys: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or set(value) != keys:
        found = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise ValueError(f"{what} must have the keys {sorted(keys)}, found {found}")
    return value


def _count(what: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def parse_state(state: Mapping[str, Any], *, num_workers: int, iterable: bool) -> EpochProgress:
    """The progress a saved state describes; raises ``ValueError`` naming what does not fit.

    ``state`` is not modified (the progress holds copies).
    """
    if isinstance(state, Mapping) and state.get("format") == _OLD_FORMAT:
        state = {**state, "format": STATE_FORMAT, "since_snapshot": 0}
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"not an omnifeed DataLoader state (format {found!r}, expected {STATE_FORMAT!r}); "
            "pass what DataLoader.state_dict() returned"
        )
    state = copy.deepcopy(dict(_exact_keys("the DataLoader state", state, _KEYS)))
    if state["status"] not in ("fresh", "running", "finished"):
        raise ValueError(f"state status must be 'fresh', 'running' or 'finished', got {state['status']!r}")
    sampler = _exact_keys("the state's 'sampler'", state["sampler"], _SAMPLER_KEYS)
    workers = _exact_keys("the state's 'workers'", state["workers"], _WORKER_KEYS)
    count = _count("workers.count", workers["count"])
    slots = max(1, count)
    if len(workers["datasets"]) != slots or len(workers["ended"]) != slots:
        raise ValueError(f"the state lists {len(workers['datasets'])} dataset states for {count} workers")
    if any(s is not None for s in workers["datasets"]) or (iterable and state["yielded"]):
        if count != num_workers:
            raise WorkerCountError(
                f"the state was saved with num_workers={count} and holds each worker's place in the dataset; "
                f"resume with num_workers={count}"
            )
    base_seed = state["base_seed"]
    if base_seed is not None and not isinstance(base_seed, int):
        raise ValueError(f"state base_seed must be an integer or None, got {base_seed!r}")
    replay = sampler["replay"]
    if replay is not None:
        _exact_keys("the state's sampler.replay", replay, _REPLAY_KEYS)
        if not isinstance(replay["generators"], list):
            raise ValueError("state sampler.replay.generators must be a list of generator states")
        if not isinstance(replay["draws_base_seed"], bool) or not isinstance(replay["pulled"], bool):
            raise ValueError("state sampler.replay.draws_base_seed and .pulled must be booleans")
    snapshot = sampler["snapshot"]
    if snapshot is not None:
        _exact_keys("the state's sampler.snapshot", snapshot, {"sampler", "iterator"})
    also = sampler["also_yielded"]
    if not isinstance(also, list) or any(_count("also_yielded", t) <= sampler["consumed"] for t in also):
        raise ValueError("state sampler.also_yielded must list tasks after sampler.consumed")
    same_workers = count == num_workers  # else map-style without dataset states: any worker count resumes
    return EpochProgress(
        num_workers=num_workers,
        base_seed=base_seed,
        status=state["status"],
        yielded=_count("yielded", state["yielded"]),
        consumed=_count("sampler.consumed", sampler["consumed"]),
        also_yielded=set(also),
        replay=sampler["replay"],
        snapshot=sampler["snapshot"],
        datasets=list(workers["datasets"]) if same_workers else [],
        ended=[bool(e) for e in workers["ended"]] if same_workers else [],
        next_worker=_count("workers.next", workers["next"]) % slots if same_workers else 0,
        since_snapshot=_count("since_snapshot", state["since_snapshot"]),
    )
