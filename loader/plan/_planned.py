"""`PlannedEpochs`: a cost budget's (or packing's) epochs planned once ahead of training, dealt by micro-batch number.

A budget's micro-batches are known only by planning their windows, and a step of a large world
spans whole windows (65,536 micro-batches at dp 4,096 × accum 16): dealing it live costs every
node a plan of the world's step. Planned ahead (``omnifeed plan INDEX --budget B --write-epochs N``,
a pre-caching job like the index build), an epoch is a few arrays, read by ranges: every micro-batch's
sample positions and cost, and each window's start, first micro-batch and the ids carried into it
(a micro-batch's window is found from the firsts). The cursor then finds the micro-batches a rank
asks for, and its own state after a step, by number, at any world size: what live planning deals,
micro-batch for micro-batch and state for state (`tests/loader/plan/test_planned.py`), for a few
look-ups.

The files are derived, like the index's ``lengths.npy``: written under the index
(``plans/<config fingerprint>/epoch-<n>/``), or for a mixture in the folder its config names
(``plan.mixture.plans``: ``<config fingerprint>-<schedule fingerprint>/epoch-<n>/``, each window's
schedule position recorded beside), and used only where they hold. An epoch not written, a budget
changed by memory feedback, a cursor off the files' path (a state saved under another budget history,
a mixture changed or resumed under other weights) or files that do not check out are planned live,
with the same result.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from omnifeed.bucketing import Pack, Segment

from ._micro_batch import _NOTHING, MicroBatch

if TYPE_CHECKING:
    from ._plan import Plan

logger = logging.getLogger(__name__)

PLANNED_FORMAT = "omnifeed.planned-epoch/2"  # /2: no windows.npy (each micro-batch's window is the table's)
PLANS_DIR = "plans"
_HEADER = "epoch.json"
_SEGMENTS = ("segment_starts", "segment_stops")  # packing's: each position's slice of its sample's sequence
_OPEN_EPOCHS = 4  # planned epochs kept open per plan (each holds a few files; streams are an epoch or two apart)
_MIXTURE = "mixture.json"  # a mixture's: each window's schedule position (`MixtureStream.state` at its start)

CursorState = tuple[int, int, int, int, int, np.ndarray]
"""The cursor's place before a micro-batch: (epoch, window, window start, offset, micro-batch, carried ids)."""


def plans_directory(folder: str | Path | None, plan: Plan) -> Path | None:
    """Where ``plan``'s planned epochs live: under the index at ``folder`` (its ``plans/``), or for a mixture in
    ``folder`` itself; ``folder`` None: the plan's own (its index's, or its mixture's ``plans``). None: nowhere (a
    mixture whose config names no ``plans`` folder, a plan of no index)."""
    mixture = plan.mixture
    if mixture is not None:
        named = folder if folder is not None else (plan.config.mixture.plans if plan.config.mixture else None)
        return None if named is None else Path(named) / f"{plan.config_fingerprint}-{mixture.fingerprint}"
    index = folder if folder is not None else plan.index_path
    return None if index is None else Path(index) / PLANS_DIR / plan.config_fingerprint


def _plannable(plan: Plan) -> str | None:
    """Why ``plan``'s epochs cannot be written ahead (None: they can)."""
    if plan.bucketing is None:
        return (
            "only a cost budget's or packing's epochs are planned ahead (fixed-size batches are dealt in closed form "
            "already)"
        )
    return None


def _packing(plan: Plan) -> bool:
    return plan.bucketing is not None and plan.bucketing.mode == "packing"


class _AppendedArray:
    """A one-dimensional ``.npy`` file written piece by piece (the memory of writing an epoch is a window's, whatever
    the epoch's size): its header, whose length does not depend on the count, is written again at the end."""

    def __init__(self, path: Path, dtype: type) -> None:
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed by save)
        self._header = self._header_for(0)
        self._file.write(self._header)

    def _header_for(self, count: int) -> bytes:
        out = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            out, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (count,)}
        )
        return out.getvalue()

    def add(self, values: Any) -> None:
        array = np.ascontiguousarray(values, dtype=self.dtype)
        array.tofile(self._file)
        self.count += len(array)

    def save(self) -> int:
        header = self._header_for(self.count)
        if len(header) != len(self._header):  # numpy leaves room for the count to grow; never seen otherwise
            raise RuntimeError(f"{self.path}: the .npy header changed length ({len(self._header)} -> {len(header)})")
        self._file.seek(0)
        self._file.write(header)
        self._file.close()
        return self.count


def _write_epoch(plan: Plan, epoch: int, folder: Path) -> tuple[int, int, int]:
    """Epoch ``epoch`` planned window by window at the configured budget (the cursor's walk), its arrays written
    into ``folder``: (micro-batches, windows, samples)."""
    positions = _AppendedArray(folder / "positions.npy", np.int64)
    bounds = _AppendedArray(folder / "bounds.npy", np.int64)
    costs = _AppendedArray(folder / "costs.npy", np.float64)
    packed = _packing(plan)  # a pack's segments: each sample's slice of its sequence, beside its position
    segments = [_AppendedArray(folder / f"{name}.npy", np.int64) for name in _SEGMENTS] if packed else []
    table: list[tuple[int, int, int]] = []
    carries: list[np.ndarray] = []
    schedule: list[dict[str, Any]] = []  # a mixture's position at each window's start
    bounds.add([0])
    window, start, carried, first, samples = 0, 0, _NOTHING, 0, 0
    while True:
        if plan.mixture is not None:
            schedule.append(plan.mixture.state(epoch, start))
        planned = plan.window(epoch, window, start, budget=plan.budget, first_index=first, carried=carried)
        batches = planned.micro_batches
        if batches:
            positions.add(np.concatenate([mb.positions for mb in batches]))
        if segments:
            slices = [s for mb in batches if mb.pack is not None for s in mb.pack.segments]
            segments[0].add(np.fromiter((s.start for s in slices), dtype=np.int64, count=len(slices)))
            segments[1].add(np.fromiter((s.stop for s in slices), dtype=np.int64, count=len(slices)))
        sizes = np.fromiter((len(mb.positions) for mb in batches), dtype=np.int64, count=len(batches))
        bounds.add(samples + np.cumsum(sizes))
        samples += int(sizes.sum())
        costs.add(np.fromiter((mb.cost for mb in batches), dtype=np.float64, count=len(batches)))
        table.append((start, first, len(batches)))
        carries.append(np.asarray(carried, dtype=np.int64))
        first += len(batches)
        if planned.last:
            break
        window, start, carried = window + 1, planned.next_start, planned.carry
    for appended in (positions, bounds, costs, *segments):
        appended.save()
    np.save(folder / "window_table.npy", np.asarray(table, dtype=np.int64).reshape(-1, 3))
    np.save(folder / "carried.npy", np.concatenate(carries))
    np.save(folder / "carried_bounds.npy", np.concatenate([[0], np.cumsum([len(c) for c in carries])]).astype(np.int64))
    if plan.mixture is not None:
        (folder / _MIXTURE).write_text(json.dumps(schedule) + "\n", encoding="utf-8")
    return first, len(table), samples


def write_planned_epochs(
    plan: Plan,
    folder: str | Path | None,
    epochs: range,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Plan ``epochs`` of ``plan`` and write them under the index at ``folder`` (its ``plans/`` folder), or for a
    mixture into ``folder``; None: the plan's own (its index's, or its mixture config's ``plans``).

    Each epoch is written to a temporary folder and renamed into place, so a reader sees it whole or
    not at all; an epoch already there is replaced. ``progress(epoch, micro_batches)`` after each. A
    mixture's epochs follow its schedule as it stands (a cursor that resumed a changed mixture moved it).
    Raises ValueError for a plan whose epochs are not planned ahead (fixed-size batches) or that has nowhere to
    write them.
    """
    why = _plannable(plan)
    if why is not None:
        raise ValueError(why)
    root = plans_directory(folder, plan)
    if root is None:
        raise ValueError(
            "a mixture's epochs are written into the folder its config names: set plan.mixture.plans "
            "(relative to the config file)"
            if plan.mixture is not None
            else "no index to write the planned epochs under: give the index's folder"
        )
    root.mkdir(parents=True, exist_ok=True)
    for epoch in epochs:
        staging = root / f".epoch-{epoch}.{os.getpid()}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            micro_batches, windows, samples = _write_epoch(plan, epoch, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # a plan that failed (a sample over the budget) leaves nothing
            raise
        header = {
            "format": PLANNED_FORMAT,
            "index_fingerprint": plan.index_fingerprint,
            "config_fingerprint": plan.config_fingerprint,
            "budget": plan.budget,
            "schedule": plan.mixture.fingerprint if plan.mixture is not None else None,
            "packing": _packing(plan),
            "epoch": epoch,
            "micro_batches": micro_batches,
            "windows": windows,
            "samples": samples,
        }
        (staging / _HEADER).write_text(json.dumps(header) + "\n", encoding="utf-8")
        final = root / f"epoch-{epoch}"
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        if progress is not None:
            progress(epoch, micro_batches)
    return root


class _ArrayFile:
    """A one-dimensional ``.npy`` file read by ranges (``pread``), not mapped: a look-up costs a read of the bytes it
    needs, and the process's resident memory holds none of the file (the kernel's page cache does, shared)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            reader = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = reader(f)
            self.offset = f.tell()
        if len(shape) != 1 or fortran or dtype.hasobject:
            raise ValueError(f"{path.name} is not a one-dimensional array")
        self.dtype, self.length = dtype, int(shape[0])
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        if os.fstat(self._fd).st_size != self.offset + self.length * dtype.itemsize:
            raise ValueError(f"{path.name} is not as long as its header says")

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)``."""
        size = self.dtype.itemsize
        data = os.pread(self._fd, (stop - start) * size, self.offset + start * size)
        return np.frombuffer(data, dtype=self.dtype)

    def at(self, i: int) -> Any:
        """Element ``i``."""
        return self.read(i, i + 1)[0]


class PlannedEpoch:
    """One planned epoch: its window table in memory, the rest read by ranges where a look-up needs it."""

    def __init__(self, folder: Path, header: dict[str, Any]) -> None:
        self.folder, self._warned = folder, False
        self.epoch, self.size = int(header["epoch"]), int(header["micro_batches"])
        self.positions, self.bounds = _ArrayFile(folder / "positions.npy"), _ArrayFile(folder / "bounds.npy")
        self.costs, self.carried = _ArrayFile(folder / "costs.npy"), _ArrayFile(folder / "carried.npy")
        self.table = np.load(folder / "window_table.npy")  # a row a window: small, and searched on every look-up
        self.carried_bounds = np.load(folder / "carried_bounds.npy")
        windows = int(header["windows"])
        if (
            len(self.bounds) != self.size + 1
            or len(self.costs) != self.size
            or self.table.shape != (windows, 3)
            or self.carried_bounds.shape != (windows + 1,)
            or int(self.bounds.at(self.size)) != len(self.positions)
            or len(self.positions) != int(header["samples"])
            or int(self.carried_bounds[-1]) != len(self.carried)
        ):
            raise ValueError("its arrays do not agree with its header")
        self._firsts = self.table[:, 1]  # each window's first micro-batch: where a micro-batch's window is found
        self.segments: list[_ArrayFile] | None = None  # packing's: each position's slice of its sequence
        if header.get("packing"):
            self.segments = [_ArrayFile(folder / f"{name}.npy") for name in _SEGMENTS]
            if any(len(array) != len(self.positions) for array in self.segments):
                raise ValueError("its segments do not agree with its positions")
        self.schedule: list[dict[str, Any]] | None = None  # a mixture's position at each window's start
        if header.get("schedule") is not None:
            self.schedule = json.loads((folder / _MIXTURE).read_text(encoding="utf-8"))
            if not isinstance(self.schedule, list) or len(self.schedule) != windows:
                raise ValueError(f"its {_MIXTURE} does not hold one schedule position per window")

    def off_schedule(self) -> None:
        """Say once that a cursor's mixture is not where these files have it (weights changed since they were
        written): it is planned live."""
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s: written under another history of this mixture's weights (changed since, each source going on "
                "from its count): planned live, the same micro-batches. Write it from the state the run resumed: "
                "`omnifeed plan --config FILE --resume STATE --allow-mixture-change --write-epochs N`",
                self.folder,
            )

    def micro_batch(self, g: int) -> MicroBatch:
        start, stop = (int(b) for b in self.bounds.read(g, g + 2))
        positions = self.positions.read(start, stop).copy()
        pack = None
        if self.segments is not None:
            starts, stops = (array.read(start, stop).tolist() for array in self.segments)
            pack = Pack(tuple(Segment(p, a, b) for p, a, b in zip(positions.tolist(), starts, stops)))
        window, last = self._window_of(g), g == self.size - 1
        return MicroBatch(self.epoch, g, window, positions, float(self.costs.at(g)), pack, last)

    def _window_of(self, g: int) -> int:
        """The window micro-batch ``g`` belongs to: the last whose first micro-batch is at or before it (a window that
        deals nothing shares its first with the next one, so it is never the last such)."""
        return int(np.searchsorted(self._firsts, g, side="right")) - 1

    def _window(self, window: int) -> tuple[int, int, int, np.ndarray]:
        start, first, count = (int(v) for v in self.table[window])
        carried = self.carried.read(int(self.carried_bounds[window]), int(self.carried_bounds[window + 1])).copy()
        return start, first, count, carried

    def state_before(self, g: int) -> CursorState:
        """The cursor's state once micro-batches ``[0, g)`` are dealt (``g`` = the epoch's size: the next epoch's
        start)."""
        if g >= self.size:
            return self.epoch + 1, 0, 0, 0, 0, _NOTHING
        if g == 0:
            return self.epoch, 0, 0, 0, 0, _NOTHING
        window = self._window_of(g - 1)
        start, first, count, carried = self._window(window)
        if g - first < count:
            return self.epoch, window, start, g - first, g, carried
        # the window's last was dealt: the cursor has moved on to the next (which may deal nothing)
        start, _, _, carried = self._window(window + 1)
        return self.epoch, window + 1, start, 0, g, carried


class PlannedEpochs:
    """A budget plan's epochs written ahead under its index, each checked against the plan when first used."""

    def __init__(self, root: Path, plan: Plan) -> None:
        self.root, self.plan = root, plan
        self._epochs: dict[int, PlannedEpoch | None] = {}

    @classmethod
    def find(cls, folder: str | Path | None, plan: Plan) -> PlannedEpochs | None:
        """The planned epochs of ``plan`` (where `plans_directory` says), or None when none were written."""
        if _plannable(plan) is not None:
            return None
        root = plans_directory(folder, plan)
        if root is None or not root.is_dir():
            return None
        written = sorted(int(p.name.split("-")[1]) for p in root.glob("epoch-*") if p.name.split("-")[1].isdigit())
        logger.info("%s: epochs %s of this budget written ahead: dealt by look-up", root, written)
        return cls(root, plan)

    def epoch(self, epoch: int) -> PlannedEpoch | None:
        """Planned epoch ``epoch``, or None (not written, or its files do not check out: then logged once)."""
        if epoch not in self._epochs:
            self._epochs[epoch] = self._open(epoch)
            opened = sorted(e for e, planned in self._epochs.items() if planned is not None)
            for old in opened[:-_OPEN_EPOCHS]:  # a long run opens epoch after epoch: their files are closed again
                del self._epochs[old]
        return self._epochs[epoch]

    def _open(self, epoch: int) -> PlannedEpoch | None:
        folder = self.root / f"epoch-{epoch}"
        if not folder.is_dir():
            logger.warning(
                "%s: epoch %d of this budget was not written ahead: it is planned live, every node planning the "
                "world's steps; write it with `omnifeed plan %s ... --write-epochs N --epoch %d`",
                self.root,
                epoch,
                _source(self.plan),
                epoch,
            )
            return None
        try:
            header = json.loads((folder / _HEADER).read_text(encoding="utf-8"))
            expected = {
                "format": PLANNED_FORMAT,
                "index_fingerprint": self.plan.index_fingerprint,
                "config_fingerprint": self.plan.config_fingerprint,
                "budget": self.plan.budget,
                "schedule": self.plan.mixture.fingerprint if self.plan.mixture is not None else None,
                "epoch": epoch,
            }
            wrong = sorted(k for k, v in expected.items() if header.get(k) != v)
            if wrong:
                raise ValueError(f"written for another {', '.join(wrong)}")
            return PlannedEpoch(folder, header)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning(
                "%s: planned epoch not used (%s); it is planned live instead, the same micro-batches. Write it "
                "again with `omnifeed plan %s ... --write-epochs`",
                folder,
                exc,
                _source(self.plan),
            )
            return None


def _source(plan: Plan) -> str:
    """What ``omnifeed plan`` is given to plan ``plan``: its index, or the config naming its mixture."""
    return "--config FILE" if plan.mixture is not None else "INDEX"


_FOUND: weakref.WeakKeyDictionary[Plan, PlannedEpochs | None] = weakref.WeakKeyDictionary()


def planned_epochs(plan: Plan) -> PlannedEpochs | None:
    """``plan``'s epochs written ahead (`write_planned_epochs`: under its index, or its mixture's ``plans``), or None;
    looked up once per plan."""
    if plan not in _FOUND:
        _FOUND[plan] = PlannedEpochs.find(None, plan)
    return _FOUND[plan]
