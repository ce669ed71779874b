"""Sources: fsspec URLs expanded into shards, and one field read back by its index location.

Three kinds of shard, all named by fsspec URL (or local path) (scanned by ``_scan``):

- ``tar``: a WebDataset shard. A sample is a run of adjacent members sharing a key (the
  member path up to the first dot of its basename); the rest of the name, lower-cased, is
  the field. Fields are read back with one ranged read (data offset and size).
- ``parquet``: one row per sample, keyed by ``IndexConfig.key_column``; every other
  column is a field named by its lower-cased column name; null cells are absent fields.
- ``folder``: files grouped by key as in a tar, relative path up to the first dot of the
  basename; hidden files and folders (name starting with '.') are skipped; a file whose real
  path leaves the folder (a symbolic link to outside it), a linked folder and a link loop are
  refused; FIFOs, sockets and devices are skipped, never opened (docs/security.md §4). Local
  folder files are opened by ``open_beneath``: one component at a time with ``O_NOFOLLOW``
  relative to the folder's descriptor, so a link swapped in cannot lead outside the folder.

A Parquet cell's field bytes are the value itself for binary columns, UTF-8 for string
columns and JSON text for any other type (numbers, lists, structs). Errors that mean the
source is missing or malformed raise SourceError naming the URL, the member or key, and what
to do; connection errors and timeouts propagate (with a note) so that callers can retry.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import re
import stat
import tarfile
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from braceexpand import braceexpand
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ._config import IndexConfig
from .._errors import SourceError, add_context
from ._records import FieldLocation, ShardSpec, SourceKind

logger = logging.getLogger(__name__)

_COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
RECREATE_SHARD = "re-create the shard"
_BINARY_TYPES = ("binary", "large_binary", "fixed_size_binary", "binary_view")  # pyarrow.types.is_*
_STRING_TYPES = {"string": "binary", "large_string": "large_binary", "string_view": "binary_view"}  # its binary twin


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
    return None


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
        return SourceError(f"{spec}: none of the {total} paths it names exists (the first is {missing[0]}); "
                           "check the folder and the range", url=spec)
    folders = {posixpath.dirname(m) for m in missing}
    names = [posixpath.basename(m) for m in missing] if len(folders) == 1 else list(missing)
    shown = ", ".join(names[:5]) + (f" and {absent - 5} more" if absent > 5 else "")
    verb = "does" if absent == 1 else "do"
    return SourceError(f"{spec}: {absent} of the {total} paths it names {verb} not exist ({shown}); "
                       f"{total - absent} exist: create the missing ones or narrow the range", url=spec)


def _glob(spec: str, url: str, fs: Any, pattern: str) -> dict[str, SourceKind]:
    """Sorted matches of a glob that are shards; other files are skipped with a warning."""
    matches = fs.glob(pattern, detail=True)
    if not matches:
        raise SourceError(f"{spec}: no file or folder matches the pattern {url}; check the folder and the pattern",
                          url=spec)
    found: dict[str, SourceKind] = {}
    for match, info in sorted(matches.items()):
        kind = _kind_by_name(match, spec) or ("folder" if info.get("type") == "directory" else None)
        if kind is None:
            logger.warning("%s: skipping %s: neither a .tar, a .parquet/.pq file nor a folder", spec, match)
        else:
            found[match] = kind
    if not found:
        raise SourceError(f"{spec}: the pattern {url} matches no .tar, .parquet/.pq file or folder", url=spec)
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
    absent = [url for url, _, _, fs, path, is_glob in parsed if not is_glob and (
        (id(fs), path) in missing if _kind_by_name(path, spec) is not None else not fs.exists(path))]
    if absent:  # all of them at once: a range with holes says which and how many exist
        raise _missing_error(spec, [url for url, *_, is_glob in parsed if not is_glob], absent)
    shards: list[ShardSpec] = []
    for url, prefix, explicit, fs, path, is_glob in parsed:
        if is_glob:
            found = _glob(spec, url, fs, path)
        else:
            kind = _kind_by_name(path, spec) or ("folder" if fs.isdir(path) else None)
            if kind is None:
                raise SourceError(f"{spec}: {url} is neither a .tar, a .parquet/.pq file nor a folder", url=spec)
            found = {path: kind}
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


def escapes_root(name: str) -> bool:
    """Whether a member path is empty, absolute or has a '..' component (would leave its root)."""
    return not name or name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/")


def link_outside(fs: Any, root: str, relative: str) -> str | None:
    """Where a folder's file really is, when a symbolic link takes it outside ``root`` (local files); else None."""
    if not isinstance(fs, LocalFileSystem):
        return None  # object stores and HTTP have no links
    real = os.path.realpath(os.path.join(root, relative))
    return None if inside_root(os.path.realpath(root), real) else real


def inside_root(real_root: str, path: str) -> bool:
    """Whether the real path ``path`` is ``real_root`` or below it."""
    return path == real_root or path.startswith(real_root.rstrip(os.sep) + os.sep)


OPENAT = os.open in os.supports_dir_fd and os.readlink in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW")
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO for reading would wait for a writer; the file type is checked once opened
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_MAX_LINKS = 40  # as the kernel's own limit for one path
_FIX_LINK = "copy the file into the folder or remove the link, then re-run `omnifeed index`"


def file_type(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link")):
        if test(mode):
            return name
    return "regular file" if stat.S_ISREG(mode) else "special file"


def open_beneath(root: str, relative: str, where: str, url: str) -> int:
    """A read-only descriptor of the regular file ``relative`` under the local folder ``root``.

    The path is walked one component at a time, each opened with ``O_NOFOLLOW`` relative to
    the descriptor of the folder above it; a symbolic link met on the way is resolved here,
    and only while it stays inside ``root`` (``..`` never climbs above it). A link swapped in
    by a concurrent writer is therefore seen as a link, never followed by the kernel: no
    outside file can be opened, whatever happens to the folder meanwhile. FIFOs, sockets and
    devices are opened without blocking and refused. Raises SourceError (prefixed ``where``)
    for a link leading outside, a link loop or a file that is not regular; OSError otherwise.
    """
    stack = [os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))]
    names: list[str] = []  # the folders walked below root (real ones: links are never opened)
    pending = relative.split("/")
    pending.reverse()  # a stack: the next component last
    links = 0
    real_root = ""
    try:
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if len(stack) == 1:
                    raise SourceError(f"{where}: the path leads above the folder; {_FIX_LINK}", url=url)
                os.close(stack.pop())
                names.pop()
                continue
            last = all(p in ("", ".") for p in pending)
            try:
                fd = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=stack[-1])
            except OSError as exc:
                links += 1
                if links > _MAX_LINKS:
                    raise SourceError(f"{where}: a symbolic link loop (more than {_MAX_LINKS} links); remove or fix "
                                      "the link, then re-run `omnifeed index`", url=url) from None
                try:
                    os.readlink(part, dir_fd=stack[-1])
                except OSError as not_link:
                    if not_link.errno == errno.EINVAL and exc.errno in (errno.ELOOP, errno.EMLINK):
                        pending.append(part)  # a link when opened, not now (swapped back): open it again
                        continue
                    raise exc from None
                # A link: where the kernel would resolve it, as a name only; that name is walked again
                # from the root, component by component, so what it leads to is checked the same way.
                real_root = real_root or os.path.realpath(root)
                try:
                    real = os.path.realpath(os.path.join(real_root, *names, part))
                except OSError:  # swapped again while realpath read it (EINVAL): open the component again
                    pending.append(part)
                    continue
                if not inside_root(real_root, real):
                    raise SourceError(f"{where}: a symbolic link to {real}, outside the folder; {_FIX_LINK}",
                                      url=url) from None
                while len(stack) > 1:
                    os.close(stack.pop())
                names.clear()
                pending.extend(reversed(real[len(real_root):].split("/")))
                continue
            if last:
                try:
                    mode = os.fstat(fd).st_mode
                    if not stat.S_ISREG(mode):
                        raise SourceError(f"{where}: a {file_type(mode)}, not a regular file; remove it from the "
                                          "folder", url=url)
                except BaseException:
                    os.close(fd)
                    raise
                return fd
            stack.append(fd)
            names.append(part)
        raise IsADirectoryError(errno.EISDIR, "a folder, not a file", relative)
    finally:
        for descriptor in stack:
            os.close(descriptor)


def read_whole(fd: int, size: int) -> bytes:
    """``size`` bytes from the start of an open file, fewer when it is shorter."""
    data = os.pread(fd, size, 0)
    if 0 < len(data) < size:  # a short read that is not the end (rare; large reads on some file systems)
        parts = [data]
        done = len(data)
        while done < size and (more := os.pread(fd, size - done, done)):
            parts.append(more)
            done += len(more)
        data = b"".join(parts)
    return data


def cell_bytes(column: pa.ChunkedArray) -> list[bytes | None]:
    """A Parquet column's cells as field bytes: binary as is, strings as stored (UTF-8, unchecked here: the
    text probe and decoder judge it), anything else as JSON; SourceError for a value Python cannot hold."""
    if any(getattr(pa.types, f"is_{name}", lambda _: False)(column.type) for name in _BINARY_TYPES):
        return column.to_pylist()
    for name, twin in _STRING_TYPES.items():
        if getattr(pa.types, f"is_{name}", lambda _: False)(column.type):
            return column.cast(getattr(pa, twin)()).to_pylist()  # the stored bytes, even where they are not valid UTF-8
    try:
        values = column.to_pylist()
    except (ValueError, OverflowError) as exc:  # dates out of Python's range, invalid UTF-8 inside nested values
        raise SourceError(f"a {column.type} value cannot be converted ({type(exc).__name__}: {exc})") from None
    return [None if v is None else json.dumps(v, default=str).encode("utf-8") for v in values]


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
    if kind == "parquet" and not isinstance(exc, _TRANSIENT):  # pyarrow reports corrupt files as OSError too
        return SourceError(f"{where}: unreadable Parquet file ({exc}); re-write it, then re-index", url=url)
    add_context(exc, f"source={where}")
    return None


def _read_parquet_cell(url: str, field: FieldLocation, row_group: int, row: int) -> bytes | None:
    if row_group < 0 or row < 0:
        raise ValueError(f"{url}: reading Parquet field {field.name!r} needs row_group= and row=")
    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        table = pq.ParquetFile(f).read_row_group(row_group, columns=[field.member])
    if table.num_columns != 1 or row >= table.num_rows:
        return None
    try:
        return cell_bytes(table.column(0).slice(row, 1))[0]
    except SourceError as exc:
        raise SourceError(f"{url}: column {field.member!r} row group {row_group} row {row}: {exc}", url=url) from None


def _local_path(url: str) -> str | None:
    """The file system path of a local URL (a plain path or ``file://``), else None."""
    if url.startswith("file://"):
        return url[len("file://"):]
    return url if "://" not in url and "::" not in url else None


def read_field(shard: ShardSpec, field: FieldLocation, *, row_group: int = -1, row: int = -1) -> bytes:
    """Read one field's bytes by its index location: a ranged read of a tar member, one folder
    file, or one Parquet cell (only that row group's column chunk is read).

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
        elif shard.kind == "folder":
            if escapes_root(member):
                raise SourceError(f"{where}: the member path escapes the folder; re-run `omnifeed index`", url=url)
            local = _local_path(url)
            if local is not None and OPENAT:  # race-free (openat, O_NOFOLLOW) and without fsspec's overhead
                descriptor = open_beneath(local, member, where, url)
                try:
                    size = os.fstat(descriptor).st_size
                    if size != field.size:  # checked before reading: a file that grew is not read whole
                        raise SourceError(f"{where}: changed: expected {field.size} bytes, the file has {size}; "
                                          f"{reindex}", url=url)
                    data = read_whole(descriptor, size)
                finally:
                    os.close(descriptor)
            else:
                fs, root = url_to_fs(url)
                target = link_outside(fs, root, member)
                if target is not None:
                    raise SourceError(f"{where}: a symbolic link to {target}, outside the folder; {_FIX_LINK}",
                                      url=url)
                data = fs.cat_file(f"{root.rstrip('/')}/{member}")
        elif shard.kind == "parquet":
            cell = _read_parquet_cell(url, field, row_group, row)
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
        raise SourceError(f"{where}: truncated or changed: expected {field.size} bytes at offset {field.offset}, "
                          f"got {len(data)}; {reindex}", url=url)
    return data
