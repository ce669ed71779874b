"""The index's output folder: what may be replaced, and replacing it without deleting anyone else's files.

``build_index`` writes into a fresh folder beside ``out`` and swaps it in only when complete.
``out`` is replaced only when it is absent, or a folder of this user that is empty or holds an
omnifeed index and nothing else (its ``manifest.json`` says so); anything else is refused with
a one-line error before a shard is scanned. The old index is moved aside in one rename, so
``out`` never holds a mix of two indexes, and then only omnifeed's own files are deleted from it.

The building folder (``.NAME.building-XXXX``) holds ``BUILD_OWNER``: the pid, host and start time
of the process building it. A run killed before it could clean up (SIGKILL, a node lost) leaves
it; the next build of the same ``out`` removes it when it is provably a dead build's: a real
folder of this user holding a regular owner file of this user, written on this host, whose
process is gone (or whose pid now belongs to a process started at another time). Anything else
is left alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from .._errors import OmnifeedError, describe_uid
from ._damage import DAMAGED_FILE
from ._length_rows import EVEN_LENGTHS, LENGTH_ROWS
from ._sample_index import BY_SHARD, INDEX_FORMAT, MANIFEST, SHARDS

log = logging.getLogger(__name__)

_OWN_FILE = re.compile(r"part-\d{5,}\.(parquet|arrow|arrow\.tmp)")  # partitions, and an Arrow copy being re-made
_OWN_NAMES = {MANIFEST, SHARDS, BY_SHARD, EVEN_LENGTHS, LENGTH_ROWS, DAMAGED_FILE}


def index_files_to_replace(out: Path) -> list[str]:
    """The entries of ``out`` that replacing it deletes: none when absent or empty, an omnifeed
    index's own files when it holds one and nothing else; OmnifeedError (one line) otherwise."""
    what_to_do = f"choose another --out, or remove {out} yourself"
    if out.is_symlink():
        raise OmnifeedError(f"{out}: a symbolic link; omnifeed writes an index only to a real path: {what_to_do}")
    if not out.exists():
        return []
    if not out.is_dir():
        raise OmnifeedError(f"{out}: exists and is not a folder; {what_to_do}")
    owner = out.stat().st_uid
    if owner != os.getuid():
        raise OmnifeedError(
            f"{out}: a folder of {describe_uid(owner)}, not of this user "
            f"({describe_uid(os.getuid())}); omnifeed writes an index only to a folder of yours: "
            f"{what_to_do}"
        )
    names = sorted(entry.name for entry in out.iterdir())
    if not names:
        return []
    foreign = [
        name
        for name in names
        if not (
            (name in _OWN_NAMES or _OWN_FILE.fullmatch(name))
            and (out / name).is_file()
            and not (out / name).is_symlink()
        )
    ]
    if MANIFEST not in names or not _is_omnifeed_manifest(out / MANIFEST):
        raise OmnifeedError(
            f"{out}: not empty and not an omnifeed index (no omnifeed manifest.json); omnifeed "
            f"replaces only an empty folder or an index it wrote: {what_to_do}"
        )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OmnifeedError(
            f"{out}: holds an omnifeed index and files omnifeed did not write ({shown}), which it "
            f"will not delete: move them away, {what_to_do}"
        )
    return names


def _is_omnifeed_manifest(path: Path) -> bool:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith(INDEX_FORMAT.split("/")[0] + "/")


def replace_index(out: Path, work: Path) -> None:
    """Move the finished index ``work`` to ``out``, deleting only the old index's own files."""
    old = index_files_to_replace(out)  # again: the folder may have changed while the sources were scanned
    if not out.exists():
        work.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        os.replace(out, aside)  # onto the empty folder just made: out never holds a mix of two indexes
    except OSError:
        aside.rmdir()
        raise
    work.rename(out)
    for name in old:
        (aside / name).unlink(missing_ok=True)
    try:
        aside.rmdir()
    except OSError:  # something was written into out while it was checked: left where it is now
        log.warning("%s: files appeared in the old index while it was replaced; they are kept in %s", out, aside)


BUILD_OWNER = ".omnifeed-build-owner"
"""The file in a building folder naming the process building it: JSON ``{"pid", "host", "start"}``."""


def building_folder(out: Path) -> Path:
    """A fresh folder beside ``out`` to build its index in, holding ``BUILD_OWNER``; dead builds' folders removed."""
    remove_dead_builds(out)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "start": _started(os.getpid())}
    (work / BUILD_OWNER).write_text(json.dumps(owner), encoding="utf-8")
    return work


def release_building_folder(work: Path) -> None:
    """Take the owner file out of a finished building folder (it becomes the index, which holds only its own files)."""
    (work / BUILD_OWNER).unlink(missing_ok=True)


def remove_dead_builds(out: Path) -> list[Path]:
    """Remove the building folders of ``out`` that killed runs left (module docstring); the folders removed."""
    removed = []
    prefix = f".{out.name}.building-"
    try:
        entries = [entry for entry in out.parent.iterdir() if entry.name.startswith(prefix)]
    except OSError:
        return []
    for entry in sorted(entries):
        pid = _dead_owner(entry)
        if pid is None:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        log.info("removed %s, left by a build of %s that was stopped (process %d is gone)", entry, out, pid)
        removed.append(entry)
    return removed


def _dead_owner(folder: Path) -> int | None:
    """The pid of the dead process that built ``folder``; None unless that is certain."""
    try:
        if folder.is_symlink() or not folder.is_dir() or folder.lstat().st_uid != os.getuid():
            return None
        marker = folder / BUILD_OWNER
        info = marker.lstat()
        if not marker.is_file() or marker.is_symlink() or info.st_uid != os.getuid():
            return None
        owner = json.loads(marker.read_text(encoding="utf-8"))
        pid = int(owner["pid"])
        if owner.get("host") != socket.gethostname() or pid <= 0:
            return None  # another node's build over a shared file system: its process cannot be seen from here
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid == os.getpid():
        return None
    started = _started(pid)
    alive = started is not None or _exists(pid)
    if alive and (started is None or started == owner.get("start")):
        return None
    return pid


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process now has the pid
        return True
    return True


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot, from /proc), or None (no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
