"""Folder sources: files grouped into samples by key, as in a tar (WebDataset's convention), read confined.

A sample's key is a file's path relative to the folder up to the first dot of its basename, the
rest its field. Hidden files and folders are skipped; a link leading outside the folder, a linked
folder and a link loop refuse the folder; FIFOs, sockets and devices are skipped, never opened
(docs/security.md §4). Local files are opened with ``open_beneath``. Class folders become a
``label`` field where the layout is ImageFolder's (``_class_folders``); a folder whose samples
carry no medium at all is refused, saying what was likely meant (a folder of shards one level
down, a mapping of extensions), unless ``IndexConfig.allow_meta_only``.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import stat
from collections import Counter

from fsspec.core import url_to_fs

from .._errors import SourceError
from .._modalities import META
from ._class_folders import folder_classes, label_field
from ._config import IndexConfig
from ._confined import OPENAT, file_type, inside_root, on_local_disk, open_beneath, read_whole
from ._damage import Damage
from ._names import split_name
from ._probe import FieldProbeError
from ._records import FieldLocation, ShardScan, ShardSpec
from ._samples import FieldTwice, Items, add_field, make_sample
from ._tokenizers import TokenCounter

logger = logging.getLogger(__name__)


def _walk_local(url: str, root: str) -> list[tuple[str, str, str]]:
    """(relative path, key, field) of a local folder's sample files, sorted by path; never opens a file.

    Hidden entries are skipped, folders entered (never through a link); a link is refused when
    it loops, leads to a folder, leaves the folder or leads nowhere (named as a field); FIFOs,
    sockets and devices are skipped with a warning naming them.
    """
    real_root = os.path.realpath(root)
    folders = [""]
    found: list[tuple[str, str, str]] = []
    while folders:
        prefix = folders.pop()
        with os.scandir(os.path.join(root, prefix) if prefix else root) as entries:
            listed = sorted((entry.name, entry) for entry in entries)
        for name, entry in listed:
            relative = prefix + name
            if name.startswith("."):
                continue
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                folders.append(relative + "/")
                continue
            if stat.S_ISLNK(mode):
                mode = _link_target_mode(url, real_root, entry.path, relative)
            split = split_name(url, relative)
            if split is None:
                continue
            if mode == 0:
                raise SourceError(
                    f"{url}: {relative!r} is a symbolic link to {os.path.realpath(entry.path)}, which "
                    "does not exist; remove or fix the link",
                    url=url,
                )
            if not stat.S_ISREG(mode):
                logger.warning(
                    "%s: skipping %r: a %s, not a regular file (never opened)", url, relative, file_type(mode)
                )
                continue
            found.append((relative, *split))
    return sorted(found)


def _link_target_mode(url: str, real_root: str, path: str, relative: str) -> int:
    """The mode of what a folder's link points to (0: nothing); SourceError for a loop, a folder or a place outside."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SourceError(f"{url}: {relative!r} is a symbolic link loop; remove or fix the link", url=url) from None
        if isinstance(exc, FileNotFoundError):
            return 0
        raise
    target = os.path.realpath(path)
    where = "inside" if inside_root(real_root, target) else "outside"
    if stat.S_ISDIR(mode):
        raise SourceError(
            f"{url}: {relative!r} is a symbolic link to the folder {target} ({where} the folder); "
            "linked folders are not followed: replace the link by the folder, or give "
            f"{target} as a source of its own",
            url=url,
        )
    if where == "outside":
        raise SourceError(
            f"{url}: {relative!r} is a symbolic link to {target}, outside the folder; copy the "
            "file into the folder or remove the link",
            url=url,
        )
    return mode


def scan_folder(shard: ShardSpec, config: IndexConfig, count: TokenCounter) -> ShardScan:
    """A folder's samples: files grouped by key (WebDataset's convention), ImageFolder labels where the layout says.

    Raises SourceError for an empty folder, a folder whose samples carry no medium (unless
    ``config.allow_meta_only``: then a warning), and what ``_walk_local`` and ``folder_classes`` refuse.
    """
    url = shard.url
    fs, root = url_to_fs(url)
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise FileNotFoundError(f"no folder {root}")
    groups: dict[str, list[tuple[str, str]]] = {}
    local = on_local_disk(fs) and OPENAT  # a cache over local files (simplecache::) has links and FIFOs too
    if local:  # link loops, linked folders, FIFOs and devices handled before any file is opened
        for relative, key, name in _walk_local(url, root):
            groups.setdefault(key, []).append((name, relative))
    else:  # object stores and HTTP: no links, no special files
        for path in sorted(fs.find(root)):
            relative = path[len(root) + 1 :]
            if not path.startswith(root + "/") or any(part.startswith(".") for part in relative.split("/")):
                continue
            split = split_name(url, relative)
            if split is not None:
                groups.setdefault(split[0], []).append((split[1], relative))
    if not groups:
        raise SourceError(f"{url}: no samples (an empty folder, or only hidden files)", url=url)
    if not any(config.modality_of(name) != META for fields in groups.values() for name, _ in fields):
        if not config.allow_meta_only:  # decided from the names: nothing is read
            raise SourceError(_no_medium(url, groups, allowed=False), url=url)
        logger.warning("%s", _no_medium(url, groups, allowed=True))
    scan = ShardScan(shard, classes=folder_classes(groups, config, url))
    numbers = {name: number for number, name in enumerate(scan.classes)}
    damage = Damage(url, config.strict)
    for key in sorted(groups):
        items: Items = [label_field(key, numbers)] if numbers else []
        try:
            for name, relative in groups[key]:
                data = _read_local(url, root, relative) if local else fs.cat_file(f"{root}/{relative}")
                scan.size_bytes += len(data)
                add_field(url, key, items, FieldLocation(name, config.modality_of(name), relative, 0, len(data)), data)
            scan.samples.append(make_sample(url, key, items, count))
        except FieldTwice as exc:
            damage.add(key, relative, "field_twice", str(exc))
        except FieldProbeError as exc:
            damage.add(key, exc.member, exc.reason, str(exc))
    return damage.finish(scan)


_SHARD_SUFFIXES = (".tar", ".parquet", ".pq", ".arrow", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def _no_medium(url: str, groups: dict[str, list[tuple[str, str]]], *, allowed: bool) -> str:
    """One line for a folder none of whose samples has a medium, saying what was likely meant."""
    files = sorted(relative for fields in groups.values() for _, relative in fields)
    shards = [relative for relative in files if relative.lower().endswith(_SHARD_SUFFIXES)]
    if shards:
        first = shards[0]
        folder = posixpath.dirname(first)
        suffix = next(s for s in sorted(_SHARD_SUFFIXES, key=len, reverse=True) if first.lower().endswith(s))
        more = f" and {len(shards) - 1} more" if len(shards) > 1 else ""
        hint = (
            f"it holds shard files ({first}{more}): give those as sources, e.g. "
            f"omnifeed index '{url.rstrip('/')}/{folder + '/' if folder else ''}*{suffix}'"
        )
    else:
        counts = Counter(name.rsplit(".", 1)[-1] for fields in groups.values() for name, _ in fields)
        shown = ", ".join(f".{ext} ({n})" for ext, n in counts.most_common(4))
        hint = (
            f"its files are {shown}{' and others' if len(counts) > 4 else ''}, which omnifeed reads as meta; "
            "map their extensions to a modality in the index config's 'modalities'"
        )
    problem = f"{url}: none of its {len(groups)} samples has an image, video, audio or text field"
    if allowed:
        return f"{problem}; indexed as meta only (--allow-meta-only): {hint}"
    return f"{problem}: {hint}; or pass --allow-meta-only (IndexConfig.allow_meta_only) to index them as they are"


def _read_local(url: str, root: str, relative: str) -> bytes:
    """A local folder file's bytes, opened as ``read_field`` opens it (no link out, no FIFO)."""
    descriptor = open_beneath(root, relative, f"{url}: {relative!r}", url)
    try:
        return read_whole(descriptor, os.fstat(descriptor).st_size)
    finally:
        os.close(descriptor)
