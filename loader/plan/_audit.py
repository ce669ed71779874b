"""Delivery records (one JSON line per delivered micro-batch) and the exactly-once check over them.

A record is ``{"epoch", "step", "rank", "keys", ...}``: ``epoch`` is the
micro-batch's own epoch, ``step`` counts steps since training began. ``omnifeed
plan`` prints these records; the service's audit logs use the same shape.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from .._errors import OmnifeedError
from ..index import MixtureIndex, SampleIndex
from ._cursor import Step
from ._plan import MicroBatch

_EXAMPLES = 5


def delivery_records(
    step: Step, index: SampleIndex | MixtureIndex, ranks: Iterable[int] | None = None
) -> Iterator[dict[str, Any]]:
    """The records of one step, rank by rank and accumulation micro-step by micro-step.

    In packing mode a record also has ``segments``: the ``[start, stop)`` token range of each
    key in the pack (a sample longer than a pack is split across several records).
    """
    for rank in range(step.world_size) if ranks is None else ranks:
        for accum, mb in enumerate(step.for_rank(rank)):
            yield delivery_record(step, rank, accum, mb, index.keys(mb.positions))


def delivery_record(step: Step, rank: int, accum: int, mb: MicroBatch, keys: list[str]) -> dict[str, Any]:
    """The record of one delivered micro-batch (``keys``: its planned sample keys, in order)."""
    record: dict[str, Any] = {
        "epoch": mb.epoch,
        "step": step.step,
        "rank": rank,
        "accum": accum,
        "micro_batch": mb.index,
        "window": mb.window,
        "world_size": step.world_size,
        "topology_version": step.topology_version,
        "cost": mb.cost,
        "keys": keys,
    }
    if mb.pack is not None:
        record["segments"] = [[s.start, s.stop] for s in mb.pack.segments]
    return record


def open_audit_log(path: str | Path) -> IO[str]:
    """``path`` opened to append records: created 0600, never through a link, refused if another user could write it.

    ``O_NOFOLLOW``: a link planted at ``path`` is refused (it would make omnifeed append where the
    link points); ``O_NONBLOCK`` at open: a FIFO planted there is refused rather than waited on.
    An existing file must be a regular file of this user, not writable by group or others (another
    user could read the delivered keys, or forge the records `omnifeed verify` trusts), with one
    link (a hard link planted at ``path`` would make omnifeed append to another file of the user).
    Raises OmnifeedError naming the file and what to do.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        why = (
            "it is a symbolic link"
            if exc.errno == errno.ELOOP or os.path.islink(path)
            else "it is a FIFO"
            if exc.errno == errno.ENXIO
            else exc.strerror
        )
        raise OmnifeedError(
            f"cannot open the audit log {path} ({why}); remove it or choose another audit_log path"
        ) from None
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or mode & 0o022 or info.st_nlink != 1:
        os.close(fd)
        what = (
            "is not a regular file"
            if not stat.S_ISREG(info.st_mode)
            else f"belongs to uid {info.st_uid} with mode {mode:o}: another user could read or forge its records"
            if info.st_uid != os.getuid() or mode & 0o022
            else f"has {info.st_nlink} hard links: a link planted there would have omnifeed append to another of "
            "your files"
        )
        raise OmnifeedError(
            f"audit log {path} {what}; remove it, or choose an audit_log path of your own (it is created 0600)"
        )
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "a", encoding="utf-8")


def read_delivery_logs(paths: Iterable[str | Path], stdin: IO[str] | None = None) -> Iterator[dict[str, Any]]:
    """Records from JSON-lines files (``-`` reads ``stdin``); a malformed line names its file and line.

    A file another user could have written (theirs, or writable by anyone) is refused:
    the service never writes such a log, and its records would decide what ``verify`` reports.
    """
    for path in paths:
        handle = stdin if str(path) == "-" and stdin is not None else open(path, encoding="utf-8")
        info = os.fstat(handle.fileno()) if handle is not stdin else None
        if info is not None and stat.S_ISREG(info.st_mode) and (info.st_uid != os.getuid() or info.st_mode & 0o002):
            handle.close()
            raise OmnifeedError(
                f"{path} belongs to uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):o}: another "
                "user could have written its records; verify logs your job wrote (omnifeed writes "
                "them 0600), or copy one you trust into a folder of yours"
            )
        try:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get("keys"), list):
                        raise ValueError("expected an object with a 'keys' list")
                    int(record["epoch"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise OmnifeedError(
                        f"{path}:{number}: not a delivery record ({exc}); pass logs written by omnifeed"
                    ) from exc
                yield record
        finally:
            if handle is not stdin:
                handle.close()


@dataclass
class CoverageReport:
    """How an epoch's samples were delivered: each exactly once is the only passing outcome.

    ``partial`` counts samples split across packs whose segments do not tile ``[0, end)``
    (a gap or an overlap); a split sample whose segments tile counts as delivered once.
    """

    epoch: int
    samples: int
    delivered: int
    unique: int
    duplicates: int
    missing: int
    unknown: int
    partial: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every sample of the epoch was delivered exactly once and nothing else was."""
        return (
            self.duplicates == 0
            and self.missing == 0
            and self.unknown == 0
            and self.partial == 0
            and self.delivered == self.samples
        )

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict, with ``ok``."""
        return {**asdict(self), "ok": self.ok}


def _delivery(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record["step"], record["rank"], record["accum"], record["micro_batch"], record.get("topology_version"))


def verify_coverage(index: SampleIndex, epoch: int, records: Iterable[dict[str, Any]]) -> CoverageReport:
    """Check that the records deliver every sample of ``epoch`` exactly once.

    The same delivery logged twice by the service (records with ``"since"``; step, rank,
    accumulation micro-step, micro-batch, topology and attempt all equal) counts once: a
    restarted service re-sends the batch a client had not received yet, and logs it again.

    A **returned** record (``{"returned": ATTEMPT, "step", "rank", "accum", "micro_batch", ...}``)
    takes back the delivery with those fields: a client received it ahead of its trainer and gave it
    back unused (a resize, a resume, closing).

    A **resume marker** (``{"resume": ATTEMPT, "step": S, "accum_done": A, ...}``, written by the
    service when a job that loaded a checkpoint starts a new attempt) rolls back what was
    delivered after that checkpoint and never committed: the records before it, from steps at or
    after ``S``, of other attempts (their ``"since"``) but those it names ``"live"`` (still running
    then). So a run that crashed and resumed from its last checkpoint verifies per committed step.
    """
    keys, partial = delivered_keys(epoch, records)
    positions = index.positions_of(keys) if keys else np.empty(0, dtype=np.int64)
    known = positions >= 0
    counts = np.bincount(positions[known], minlength=index.num_samples)
    repeated, absent = np.flatnonzero(counts > 1), np.flatnonzero(counts == 0)
    unknown_keys = [k for k, ok in zip(keys, known.tolist()) if not ok]
    return CoverageReport(
        epoch=epoch,
        samples=index.num_samples,
        delivered=len(keys),
        unique=int((counts > 0).sum()),
        duplicates=int((counts[repeated] - 1).sum()),
        missing=int(absent.size),
        unknown=len(unknown_keys),
        partial=partial,
        examples={
            "duplicated": index.keys(repeated[:_EXAMPLES]),
            "missing": index.keys(absent[:_EXAMPLES]),
            "unknown": unknown_keys[:_EXAMPLES],
        },
    )


def delivered_keys(epoch: int, records: Iterable[dict[str, Any]]) -> tuple[list[str], int]:
    """The keys the records deliver in ``epoch`` (by `verify_coverage`'s rules), and how many split samples
    are partial (their segments do not tile)."""
    keys: list[str] = []
    segments: dict[str, list[tuple[int, int]]] = {}
    kept: dict[tuple[Any, ...], dict[str, Any]] = {}
    for line, record in enumerate(records):
        if "resume" in record:
            at = (int(record["step"]), int(record.get("accum_done", 0)))
            spared = {record["resume"], *record.get("live", ())}
            kept = {k: r for k, r in kept.items() if r.get("since") in spared or (r["step"], r["accum"]) < at}
        elif "returned" in record:  # a client received it ahead and its trainer never had it
            kept.pop((*_delivery(record), record["returned"]), None)
        elif "since" in record:
            kept.setdefault((*_delivery(record), record["since"]), record)
        else:  # a log of the in-process feed or of `omnifeed plan`: every line is a delivery
            kept[(line, "line")] = record
    chosen = [r for r in kept.values() if int(r["epoch"]) == epoch]
    for record in chosen:
        if "segments" not in record:
            keys.extend(record["keys"])
            continue
        for key, (start, stop) in zip(record["keys"], record["segments"]):
            segments.setdefault(key, []).append((int(start), int(stop)))
    partial = 0
    for key, pieces in segments.items():
        passes = sum(start == 0 for start, _ in pieces)
        keys.extend([key] * passes)  # each full pass over a sample counts once
        # the pieces tile ``passes`` passes over [0, end) (a mixture may repeat a sample in one epoch, split
        # differently each time) when every boundary but 0 and the end starts as many pieces as it stops
        end = max(stop for _, stop in pieces)
        starts = Counter(start for start, _ in pieces) + Counter({end: passes})
        partial += passes == 0 or starts != Counter(stop for _, stop in pieces) + Counter({0: passes})
    return keys, partial
