"""The errors omnifeed raises for bad input, each naming what is wrong and what to do."""

from __future__ import annotations

import pwd


class OmnifeedError(Exception):
    """Base class of every error omnifeed raises on purpose."""


class SourceError(OmnifeedError):
    """A source (shard, table, folder or file) is missing, unreadable or malformed."""

    def __init__(self, message: str, *, url: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.key = key


class IndexFormatError(OmnifeedError):
    """An index directory is missing, incomplete or not an omnifeed index."""


class StateMismatchError(OmnifeedError):
    """A saved plan state does not belong to this index or this batching config."""


def add_context(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (``BaseException.add_note`` on Python 3.11+, ``__notes__`` before)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: keep the note where 3.11 tracebacks and tools look for it
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def describe_uid(uid: int) -> str:
    """``uid 1001 (alice)``, or ``uid 1001`` for a uid without a name: who owns a path, in an error message."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
