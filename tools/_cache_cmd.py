"""`omnifeed cache list` and `omnifeed cache remove`: the node's cache tiers, seen and removed by their owner.

A RAM tier segment (/dev/shm/omnifeed-ram-NAME) outlives its processes on purpose, so that a
restarted job finds it warm; these commands are how a user sees what is left on a node and
frees it. Nothing here takes a tier's lock or maps a segment: the figures are a snapshot read
from the files. A file in /dev/shm is removed only when it is the user's own and its header
says it is an omnifeed RAM tier; a name that merely looks like one is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import stat
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

_NVME_DEPTH = 4  # directory levels under --nvme searched for tiers


def add_cache_command(cache: argparse.ArgumentParser, command: Callable[..., argparse.ArgumentParser]) -> None:
    """The ``list`` and ``remove`` actions under ``cache``; ``command(sub, name, summary, *examples)`` makes each."""
    sub = cache.add_subparsers(dest="cache_action", required=True, metavar="ACTION")
    listing = command(
        sub,
        "list",
        "the node's RAM tier segments in /dev/shm (every user's) and, with --nvme, the NVMe tiers under a directory",
        "omnifeed cache list",
        "omnifeed cache list --nvme /local_nvme --json",
    )
    listing.add_argument(
        "--nvme",
        metavar="PATH",
        action="append",
        default=[],
        help="also list the NVMe (LMDB) tiers in PATH and its subdirectories (repeatable)",
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per tier instead of a table")
    listing.set_defaults(run=run_list)
    remove = command(
        sub,
        "remove",
        "remove RAM tier segments of yours from /dev/shm (the shared memory is freed; "
        "the next job starts with a cold RAM tier)",
        "omnifeed cache remove default",
        "omnifeed cache remove --all-mine",
    )
    remove.add_argument(
        "name", nargs="?", metavar="NAME", help="the segment's name: cache.ram.name, as `omnifeed cache list` shows it"
    )
    remove.add_argument("--all-mine", action="store_true", help="every omnifeed RAM segment of yours")
    remove.add_argument(
        "--force",
        action="store_true",
        help="remove a segment even while processes have it mapped "
        "(they keep their mapping; processes started later get a new, cold one)",
    )
    remove.set_defaults(run=run_remove)


def run_list(args: argparse.Namespace) -> int:
    """`omnifeed cache list`: a table (or JSON lines) of the RAM segments and the NVMe tiers under --nvme."""
    from omnifeed.cache import RamTier

    segments = RamTier.segments()
    tiers = [tier for path in args.nvme for tier in nvme_tiers(Path(path))]
    users = mapped_by([str(s.path) for s in segments] + [row["path"] + "/data.mdb" for row in tiers])
    ram = [
        {
            "tier": "ram",
            "name": s.name,
            "path": str(s.path),
            "owner": _user(s.owner),
            "size_bytes": s.size_bytes,
            "capacity_bytes": s.capacity_bytes,
            "entries": s.entries,
            "bytes_used": s.bytes_used,
            "last_used": _when(s.last_used),
            "state": s.state,
            "mapped_by": users.get(str(s.path), []),
        }
        for s in segments
    ]
    for row in tiers:
        row["mapped_by"] = users.get(row["path"] + "/data.mdb", [])
    if args.json:
        for row in ram + tiers:
            print(json.dumps(row))
        return 0
    folder = str(segments[0].path.parent) if segments else "/dev/shm"
    if ram:
        print(f"RAM tier segments in {folder}:")
        _table(ram, ("name", "owner", "size_bytes", "entries", "bytes_used", "last_used", "state", "mapped_by"))
        print(
            "remove one of yours with `omnifeed cache remove NAME`, "
            "all of yours with `omnifeed cache remove --all-mine`"
        )
    else:
        print(f"no omnifeed RAM tier segments in {folder}")
    for path in args.nvme:
        found = [row for row in tiers if row["root"] == str(Path(path))]
        if found:
            print(f"NVMe tiers under {path}:")
            _table(found, ("path", "owner", "size_bytes", "entries", "bytes_used", "last_used", "state", "mapped_by"))
        else:
            print(f"no omnifeed NVMe tiers under {path}")
    return 0


def run_remove(args: argparse.Namespace) -> int:
    """`omnifeed cache remove`: free RAM tier segments of the user's own."""
    from omnifeed.cache import RamTier
    from omnifeed.loader import OmnifeedError

    if (args.name is None) == (not args.all_mine):
        args.parser.error("give a segment NAME or --all-mine (one of them)")
    me = os.getuid()
    if args.all_mine:
        targets = [s for s in RamTier.segments() if s.owner == me]
        if not targets:
            print("no omnifeed RAM tier segments of yours to remove")
    else:
        name = args.name.removeprefix(RamTier.SEGMENT_PREFIX)
        segment = RamTier.segment(name)  # ValueError for a name no tier can have
        if segment is None:
            raise OmnifeedError(
                f"no omnifeed RAM tier segment named {name!r} (see `omnifeed cache list`); "
                "a file of that name that is not one is left alone"
            )
        if segment.owner != me:
            raise OmnifeedError(f"{segment.path} belongs to {_user(segment.owner)}: only its owner may remove it")
        targets = [segment]
    users = mapped_by([str(s.path) for s in targets])
    kept = 0
    for segment in targets:
        pids = users.get(str(segment.path), [])
        if pids and not args.force:
            kept += 1
            print(
                f"omnifeed: {'warning' if args.all_mine else 'error'}: kept {segment.path}: in use by process(es) "
                f"{', '.join(map(str, pids))}; stop them first, or pass --force",
                file=sys.stderr,
            )
            continue
        for path in (segment.path, segment.path.with_name(segment.path.name + ".lock")):
            _unlink_own(path, me)
        print(f"removed {segment.path} ({_size(segment.size_bytes)})" + (f", still mapped by {pids}" if pids else ""))
    return 1 if kept else 0


def _unlink_own(path: Path, uid: int) -> None:
    """Unlink ``path`` if it is a regular file of ``uid`` (never a link, a folder, another user's file)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
        path.unlink(missing_ok=True)


def nvme_tiers(root: Path) -> list[dict[str, Any]]:
    """The omnifeed NVMe tiers (LMDB environments) in ``root`` and its subdirectories, read-only and lock-free."""
    from omnifeed.loader import OmnifeedError

    if not root.is_dir():
        raise OmnifeedError(f"--nvme {root}: no such directory")
    found = []
    for folder, subfolders, files in os.walk(root):
        if len(Path(folder).relative_to(root).parts) >= _NVME_DEPTH:
            subfolders.clear()
        if "data.mdb" in files:
            subfolders.clear()
            row = _nvme_tier(Path(folder))
            if row is not None:
                found.append(row | {"root": str(root)})
    return found


def _nvme_tier(folder: Path) -> dict[str, Any] | None:
    import lmdb

    from omnifeed.cache import NvmeTier

    data = folder / "data.mdb"
    info = data.lstat()
    if not stat.S_ISREG(info.st_mode):
        return None  # a FIFO would block the open below, a link could point anywhere: not a tier
    files = [data] + [folder / name for name in ("sketch.bin", "lock.mdb") if (folder / name).is_file()]
    row: dict[str, Any] = {
        "tier": "nvme",
        "path": str(folder),
        "owner": _user(info.st_uid),
        "size_bytes": sum(f.lstat().st_blocks * 512 for f in files),
        "entries": None,
        "bytes_used": None,
        "last_used": _when(max(f.lstat().st_mtime for f in files)),
        "state": "ready",
    }
    if info.st_uid != os.getuid():
        # LMDB trusts its file's structure: another user's file is listed from its metadata, never parsed
        return row | {"state": "another user's (not opened)"}
    try:  # lock=False: take no reader slot and no lock; a snapshot is all that is asked for
        env = lmdb.open(str(folder), readonly=True, lock=False, max_dbs=len(NvmeTier.SUB_DATABASES), readahead=False)
    except lmdb.Error as exc:
        return row | {"state": f"unreadable ({exc})"}
    try:
        with env.begin() as txn:
            names = {bytes(key) for key, _ in txn.cursor()}
        if not set(NvmeTier.SUB_DATABASES) <= names:
            return None  # an LMDB environment, but not an omnifeed tier
        data_db = env.open_db(b"data", create=False)
        with env.begin() as txn:
            figures = txn.stat(data_db)
        pages = figures["branch_pages"] + figures["leaf_pages"] + figures["overflow_pages"]
        return row | {"entries": figures["entries"], "bytes_used": pages * figures["psize"]}
    except lmdb.Error as exc:
        return row | {"state": f"unreadable ({exc})"}
    finally:
        env.close()


def mapped_by(paths: Iterable[str]) -> dict[str, list[int]]:
    """Path → the processes (other than this one) that map it, from /proc/*/maps; best-effort (readable ones)."""
    wanted = set(paths)
    found: dict[str, list[int]] = {}
    if not wanted:
        return found
    for maps in Path("/proc").glob("[0-9]*/maps"):
        pid = int(maps.parent.name)
        if pid == os.getpid():
            continue
        try:
            lines = maps.read_text(errors="replace").splitlines()
        except OSError:  # gone, or another user's
            continue
        mapped = {fields[5] for fields in (line.split(None, 5) for line in lines) if len(fields) == 6}
        for path in mapped & wanted:  # (a removed file shows as "PATH (deleted)": not the one asked about)
            found.setdefault(path, []).append(pid)
    return {path: sorted(pids) for path, pids in found.items()}


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _size(value: int | None) -> str:
    if value is None:
        return "?"
    size, unit = float(value), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    def cell(row: dict[str, Any], column: str) -> str:
        value = row[column]
        if column in ("size_bytes", "bytes_used"):
            return _size(value)
        if column == "mapped_by":
            return ",".join(map(str, value)) or "-"
        return "?" if value is None else str(value)

    headers = {"size_bytes": "SIZE", "bytes_used": "USED", "last_used": "LAST USE", "mapped_by": "MAPPED BY"}
    table = [[headers.get(c, c.upper()) for c in columns]] + [[cell(row, c) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip())
