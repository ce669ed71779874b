"""Sources: fsspec URLs expanded into shards, and one field read back by its index location.

Four kinds of shard, all named by fsspec URL (or local path) (scanned by ``_scan``):

- ``tar``: a WebDataset shard. A sample is a run of adjacent members sharing a key (the
  member path up to the first dot of its basename); the rest of the name, lower-cased, is
  the field. Fields are read back with one ranged read (data offset and size).
- ``parquet``: one row per sample, keyed by ``IndexConfig.key_column`` (without a ``__key__``
  column: ``<file stem>/<row>``, ``_table_scan``); every other column is a field named by its
  lower-cased column name; null cells are absent fields.
- ``arrow``: the same for an Arrow IPC file (``.arrow``, stream or file format); a folder
  written by ``datasets``' ``save_to_disk`` (``state.json`` listing its ``data-*.arrow``
  files) is its Arrow files, in order (``_arrow_files``).
- a folder whose top holds shard files (``.tar``, ``.parquet``/``.pq``, ``.arrow``) is those shards;
- ``folder``: files grouped by key as in a tar, relative path up to the first dot of the
  basename (``_folder_scan``; class folders → labels, ``_class_folders``); hidden files and folders (name starting
  with '.') are skipped; a file whose real path leaves the folder (a symbolic link to outside it), a linked folder and a
  link loop are refused; FIFOs, sockets and devices are skipped, never opened (docs/security.md §4). Local
  folder files are opened by ``open_beneath``: one component at a time with ``O_NOFOLLOW``
  relative to the folder's descriptor, so a link swapped in cannot lead outside the folder.

A Parquet or Arrow cell's field bytes are the value itself for binary columns, UTF-8 for
string columns, the ``bytes`` member of an image/audio struct (as ``datasets`` stores them) and
JSON text for any other type (numbers, lists, structs): ``_columns``. Errors that mean the
source is missing or malformed raise SourceError naming the URL, the member or key, and what
to do; connection errors and timeouts propagate (with a note) so that callers can retry.
"""

from __future__ import annotations

import logging
import os
import posixpath
import tarfile
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from braceexpand import braceexpand
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from .._errors import SourceError, add_context
from ._arrow_files import arrow_schema, read_arrow_cell, saved_dataset_files
from ._class_folders import label_bytes
from ._columns import cell_kind
from ._config import IndexConfig
from ._confined import FIX_LINK, OPENAT, escapes_root, link_outside, on_local_disk, open_beneath, read_whole
from ._media_root import read_media_file
from ._parquet_cells import read_parquet_cell
from ._records import FieldLocation, ShardSpec, SourceKind

logger = logging.getLogger(__name__)

_COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
RECREATE_SHARD = "re-create the shard"


def _kind_by_name(path: str, spec: str) -> SourceKind | None:
    lower = path.lower().rstrip("/")
    if lower.endswith(_COMPRESSED_TAR):
        raise SourceError(
            f"{spec}: {path} is a compressed tar, which cannot be read by offset; "
            "re-pack it as a plain .tar (e.g. gunzip it)",
            url=spec,
        )
    if lower.endswith(".tar"):
        return "tar"
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    if lower.endswith(".arrow"):
        return "arrow"
    return None


def _folder_shards(fs: Any, path: str, spec: str) -> dict[str, SourceKind]:
    """A folder as shards: the Arrow files of a dataset saved by ``datasets``; else the shard files at its top
    (``.tar``, ``.parquet``/``.pq``, ``.arrow``) when it holds no sample files beside them; else the folder itself."""
    saved = saved_dataset_files(fs, path, spec)
    if saved:
        return {file: "arrow" for file in saved}
    return _top_shards(fs, path, spec) or {path: "folder"}


_SHARD_NAMES = (".tar", ".parquet", ".pq", ".arrow", *_COMPRESSED_TAR)


def _top_shards(fs: Any, path: str, spec: str) -> dict[str, SourceKind]:
    """The shard files at the top of a folder, sorted; {} when it has none. SourceError when sample files (by the
    default extensions: images, video, audio, text) lie beside them, or a shard is a compressed tar."""
    try:
        entries = sorted(fs.ls(path, detail=True), key=lambda entry: entry["name"])
    except (OSError, ValueError):
        return {}
    shards, samples, others = [], [], []
    defaults = IndexConfig()
    for entry in entries:
        name = posixpath.basename(entry["name"].rstrip("/"))
        if name.startswith("."):
            continue
        if entry.get("type") != "file":
            others.append(name + "/")
        elif name.lower().endswith(_SHARD_NAMES):
            shards.append(entry["name"])
        elif "." in name and defaults.modality_of(name.rsplit(".", 1)[-1]) != "meta":
            samples.append(name)
        else:
            others.append(name)
    if not shards:
        return {}
    if samples:
        raise SourceError(
            f"{spec}: the folder {path} holds both shard files ({posixpath.basename(shards[0])}, ...) "
            f"and sample files ({samples[0]}, ...); give the shards as sources (e.g. "
            f"'{path.rstrip('/')}/*{posixpath.splitext(shards[0])[1]}') or move them out",
            url=spec,
        )
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        logger.warning(
            "%s: indexing the %d shard files of %s; skipping what is not a shard: %s", spec, len(shards), path, shown
        )
    return {shard: kind for shard in shards if (kind := _kind_by_name(shard, spec)) is not None}


def _missing(fs: Any, paths: list[str]) -> set[str]:
    """Paths that do not exist: one listing per parent folder, then exists() for what it lacks."""
    listed: set[str] = set()
    if len(paths) > 1:  # brace lists: one listing per folder instead of one request per shard
        for parent in {posixpath.dirname(p) for p in paths}:
            try:
                listed.update(fs._strip_protocol(p) for p in fs.ls(parent, detail=False))
            except OSError:
                pass
    return {p for p in paths if p not in listed and not fs.exists(p)}


def _missing_error(spec: str, urls: list[str], missing: list[str]) -> SourceError:
    """One line for the paths of a spec that do not exist: which (the first few) and how many do."""
    if len(urls) == 1:
        return SourceError(f"{spec}: {missing[0]} does not exist", url=spec)
    total, absent = len(urls), len(missing)
    if absent == total:
        return SourceError(
            f"{spec}: none of the {total} paths it names exists (the first is {missing[0]}); "
            "check the folder and the range",
            url=spec,
        )
    folders = {posixpath.dirname(m) for m in missing}
    names = [posixpath.basename(m) for m in missing] if len(folders) == 1 else list(missing)
    shown = ", ".join(names[:5]) + (f" and {absent - 5} more" if absent > 5 else "")
    verb = "does" if absent == 1 else "do"
    return SourceError(
        f"{spec}: {absent} of the {total} paths it names {verb} not exist ({shown}); "
        f"{total - absent} exist: create the missing ones or narrow the range",
        url=spec,
    )


def _glob(spec: str, url: str, fs: Any, pattern: str) -> dict[str, SourceKind]:
    """Sorted matches of a glob that are shards; other files are skipped with a warning."""
    matches = fs.glob(pattern, detail=True)
    if not matches:
        raise SourceError(
            f"{spec}: no file or folder matches the pattern {url}; check the folder and the pattern", url=spec
        )
    found: dict[str, SourceKind] = {}
    for match, info in sorted(matches.items()):
        kind = _kind_by_name(match, spec) or ("folder" if info.get("type") == "directory" else None)
        if kind is None:
            logger.warning("%s: skipping %s: neither a .tar, .parquet/.pq or .arrow file nor a folder", spec, match)
        elif kind == "folder":
            found.update(_folder_shards(fs, match, spec))
        else:
            found[match] = kind
    if not found:
        raise SourceError(f"{spec}: the pattern {url} matches no .tar, .parquet/.pq or .arrow file or folder", url=spec)
    return found


def _resolve(spec: str, urls: list[str]) -> list[ShardSpec]:
    """Turn the brace-expanded URLs of one spec into shards: globs listed, plain paths checked."""
    parsed = []
    for url in urls:
        chain, sep, target = url.rpartition("::")
        fs, path = url_to_fs(target)
        local = isinstance(fs, LocalFileSystem) and not chain  # local paths are kept as plain absolute paths
        parsed.append((url, chain + sep, "://" in target and not local, fs, path, any(c in path for c in "*?[")))
    by_fs: dict[int, tuple[Any, list[str]]] = {}
    for _, _, _, fs, path, is_glob in parsed:
        if not is_glob and _kind_by_name(path, spec) is not None:
            by_fs.setdefault(id(fs), (fs, []))[1].append(path)
    missing = {(id(fs), p) for fs, paths in by_fs.values() for p in _missing(fs, paths)}
    absent = [
        url
        for url, _, _, fs, path, is_glob in parsed
        if not is_glob and ((id(fs), path) in missing if _kind_by_name(path, spec) is not None else not fs.exists(path))
    ]
    if absent:  # all of them at once: a range with holes says which and how many exist
        raise _missing_error(spec, [url for url, *_, is_glob in parsed if not is_glob], absent)
    shards: list[ShardSpec] = []
    for url, prefix, explicit, fs, path, is_glob in parsed:
        if is_glob:
            found = _glob(spec, url, fs, path)
        else:
            kind = _kind_by_name(path, spec) or ("folder" if fs.isdir(path) else None)
            if kind is None:
                raise SourceError(
                    f"{spec}: {url} is neither a .tar, .parquet/.pq or .arrow file nor a folder", url=spec
                )
            found = _folder_shards(fs, path, spec) if kind == "folder" else {path: kind}
        shards.extend(ShardSpec(prefix + (fs.unstrip_protocol(p) if explicit else p), k) for p, k in found.items())
    return shards


def expand_sources(specs: Sequence[str]) -> list[ShardSpec]:
    """Expand fsspec URLs, brace lists (``{000..099}``) and globs into shards, first occurrence kept.

    Local paths (and ``file://`` URLs) become absolute paths; other URLs keep their protocol
    (and ``::`` chain) prefix; glob matches are sorted. Braces expand as in WebDataset (its
    ``expand_urls`` is ``braceexpand`` plus ``WDS_*`` environment substitution, which omnifeed
    leaves out: no environment variables change what is read). Raises SourceError naming the
    spec for a missing path (for a brace list with holes: the first missing ones and how many
    exist), a pattern matching nothing or a compressed tar.
    """
    if isinstance(specs, str):
        raise TypeError("expand_sources takes a list of URLs, not one string")
    shards: dict[str, ShardSpec] = {}
    for spec in specs:
        try:
            urls = list(braceexpand(spec))
        except ValueError as exc:
            raise SourceError(f"{spec}: cannot expand ({exc})", url=spec) from exc
        for shard in _resolve(spec, urls):
            shards.setdefault(shard.url, shard)
    return list(shards.values())


_TRANSIENT = (ConnectionError, TimeoutError)


def as_source_error(exc: Exception, kind: str, where: str, url: str, fix: str) -> SourceError | None:
    """The SourceError for a missing or malformed source, or None (with a note added) for a
    storage error the caller may retry."""
    if isinstance(exc, FileNotFoundError):
        return SourceError(f"{where}: not found ({exc}); {fix}", url=url)
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError)):
        return SourceError(f"{where}: {exc}; check the URL and its permissions", url=url)
    if isinstance(exc, (tarfile.TarError, EOFError)):
        return SourceError(f"{where}: truncated or corrupt tar ({exc}); {RECREATE_SHARD}", url=url)
    if kind in ("parquet", "arrow") and not isinstance(exc, _TRANSIENT):  # pyarrow: corrupt files are OSError too
        return SourceError(f"{where}: unreadable {kind.capitalize()} file ({exc}); re-write it, then re-index", url=url)
    add_context(exc, f"source={where}")
    return None


def _read_parquet_cell(url: str, field: FieldLocation, row_group: int, row: int) -> bytes | None:
    if row_group < 0 or row < 0:
        raise ValueError(f"{url}: reading Parquet field {field.name!r} needs row_group= and row=")
    return read_parquet_cell(url, field.member, row_group, row)  # its page, through this process's kept files


def _local_path(url: str) -> str | None:
    """The file system path of a local URL (a plain path or ``file://``), else None."""
    if url.startswith("file://"):
        return url[len("file://") :]
    return url if "://" not in url and "::" not in url else None


def column_kinds(url: str, kind: SourceKind) -> dict[str, str]:
    """How each column's cells of a Parquet or Arrow file are stored: 'binary', 'string' or 'json' (its schema only)."""
    if kind == "arrow":
        schema = arrow_schema(url)
    else:
        fs, path = url_to_fs(url)
        with fs.open(path, "rb") as f:
            schema = pq.ParquetFile(f).schema_arrow
    return {field.name: cell_kind(field.type) for field in schema}


def read_field(shard: ShardSpec, field: FieldLocation, *, row_group: int = -1, row: int = -1) -> bytes:
    """Read one field's bytes by its index location: a ranged read of a tar member, one folder
    file, one Parquet cell (its own bytes read from its page, or the page decoded once per process
    while it stays in the page LRU: ``_parquet_cells``), or one Arrow cell (from the record batch
    holding it, in the file kept memory-mapped: ``_arrow_files``).

    Raises SourceError naming the URL and member when the data is gone, short or changed;
    connection errors and timeouts propagate (with a note) for the caller to retry.
    """
    url, member = shard.url, field.member
    where = f"{url}: member {member!r} (field {field.name!r})"
    reindex = "the source changed since it was indexed: restore it or re-run `omnifeed index`"
    try:
        if shard.kind == "tar":
            if field.offset < 0:
                raise ValueError(f"{where}: a tar field needs a data offset, got {field.offset}")
            local = _local_path(url)
            if local is not None:  # fsspec's per-call filesystem lookup and file object cost ~0.3 ms a field
                descriptor = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    data = os.pread(descriptor, field.size, field.offset)
                finally:
                    os.close(descriptor)
            else:
                fs, path = url_to_fs(url)
                data = fs.cat_file(path, start=field.offset, end=field.offset + field.size)
        elif shard.kind == "folder" and (label := label_bytes(field)) is not None:
            data = label  # an ImageFolder class label: its number is in the location (_class_folders)
        elif shard.kind == "folder":
            if escapes_root(member):
                raise SourceError(f"{where}: the member path escapes the folder; re-run `omnifeed index`", url=url)
            local = _local_path(url)  # a plain path or file:// without fsspec's overhead (~0.3 ms a field)
            if local is None:
                fs, root = url_to_fs(url)
                local = root if on_local_disk(fs) else None  # a cache over local files (simplecache::) has links
            if local is not None and OPENAT:  # race-free: openat, O_NOFOLLOW
                descriptor = open_beneath(local, member, where, url)
                try:
                    size = os.fstat(descriptor).st_size
                    if size != field.size:  # checked before reading: a file that grew is not read whole
                        raise SourceError(
                            f"{where}: changed: expected {field.size} bytes, the file has {size}; {reindex}", url=url
                        )
                    data = read_whole(descriptor, size)
                finally:
                    os.close(descriptor)
            else:
                fs, root = url_to_fs(url)
                target = link_outside(fs, root, member)
                if target is not None:
                    raise SourceError(f"{where}: a symbolic link to {target}, outside the folder; {FIX_LINK}", url=url)
                data = fs.cat_file(f"{root.rstrip('/')}/{member}")
        elif shard.kind in ("parquet", "arrow") and (media := read_media_file(field, url, where)) is not None:
            data = media  # a path-only cell's file, beneath the media root it was indexed with (_media_root)
        elif shard.kind in ("parquet", "arrow"):
            cell = (
                _read_parquet_cell(url, field, row_group, row)
                if shard.kind == "parquet"
                else read_arrow_cell(url, field, row)
            )
            if cell is None:
                raise SourceError(f"{where}: no value at row group {row_group} row {row}; {reindex}", url=url)
            data = cell
        else:
            raise ValueError(f"unknown shard kind {shard.kind!r}")
    except (OSError, pa.ArrowException) as exc:
        error = as_source_error(exc, shard.kind, where, url, reindex)
        if error is None:
            raise
        raise error from exc
    if len(data) != field.size:
        raise SourceError(
            f"{where}: truncated or changed: expected {field.size} bytes at offset {field.offset}, "
            f"got {len(data)}; {reindex}",
            url=url,
        )
    return data
