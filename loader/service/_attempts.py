"""`AttemptLog`: the service's audit log and the attempts its deliveries are tagged with.

An **attempt** is a run of the job since it loaded a checkpoint. Clients that load the same
checkpoint (its digest travels in the hello; ``"start"`` for a job starting from scratch) join
one attempt, however staggered their start, unless a client of that attempt left without a
goodbye (crashed, killed, stopped by torchrun: the job is restarting); then a new attempt opens
and a **resume marker** is logged (``{"resume": ATTEMPT, "epoch", "step", "accum_done",
"topology_version", "keys": []}``): deliveries of earlier attempts from that step on were never
committed, and `verify_coverage` rolls them back — except those of attempts still running then
(``"live"``: a client of theirs connected and none crashed, e.g. a rank that stayed while new
ranks join from its checkpoint: its next batch may be received before their marker). Every delivery record is tagged
``"since": ATTEMPT``. Records are written under one lock, a marker together with the attempt it
opens. docs/service.md, "Committed steps in the audit log".
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Collection
from typing import IO, Any

from ..feed import FeedPosition
from ..plan import open_audit_log


def resume_marker(attempt: str, position: FeedPosition, live: list[str] | None = None) -> dict[str, Any]:
    """The audit record that opens ``attempt`` at ``position``: where its deliveries resume (``live``: attempts still
    running, whose deliveries it does not roll back)."""
    marker: dict[str, Any] = {
        "resume": attempt,
        "epoch": position.epoch,
        "step": position.step,
        "accum_done": position.accum_done,
        "topology_version": position.topology_version,
        "keys": [],
    }
    if live:
        marker["live"] = live
    return marker


class AttemptLog:
    """Attempts keyed by checkpoint digest, and the audit log (``path``; None: attempts are kept, nothing written)."""

    def __init__(self, path: str | None) -> None:
        self._file: IO[str] | None = open_audit_log(path) if path else None
        self._lock = threading.Lock()
        self._attempts: dict[str, tuple[str, bool]] = {}  # checkpoint digest -> (its latest attempt, crashed)

    def join(
        self,
        attempt: str | None,
        resume: str | None,
        position: FeedPosition,
        running: Callable[[], Collection[str]] = frozenset,
    ) -> str | None:
        """The attempt a client's deliveries belong to.

        ``attempt``: the one the client already knows (it reconnects, to this service or a
        restarted one): kept. Else ``resume``: the digest of the checkpoint it just loaded; it
        joins the attempt that loaded it, unless that attempt crashed; else a new attempt opens
        and a resume marker at ``position`` (the client's) is logged, naming the attempts ``running()`` returns (those
        with a client connected) that did not crash. None: neither.
        """
        with self._lock:
            if attempt is not None or resume is None:
                return attempt
            current = self._attempts.get(resume)
            if current is not None and not current[1]:
                return current[0]
            opened = f"{resume}-{uuid.uuid4().hex[:8]}"
            over = {known for known, crashed in self._attempts.values() if crashed}
            self._attempts[resume] = (opened, False)
            self._write(resume_marker(opened, position, sorted(set(running()) - over)))  # asked only here
            return opened

    def crashed(self, attempt: str) -> None:
        """A client of ``attempt`` left without a goodbye: that attempt is over (the next load opens another)."""
        with self._lock:
            for checkpoint, (known, _) in list(self._attempts.items()):
                if known == attempt:
                    self._attempts[checkpoint] = (known, True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one delivery record (if there is a log)."""
        with self._lock:
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the log (idempotent); later records are dropped."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
