"""Scanning one shard into ScannedSample records: keys, field locations, lengths, digests.

WebDataset conventions for tar shards and folders: a sample's key is the member path up
to the first dot of its basename, the rest (lower-cased) its field; a tar sample's members
are adjacent. Parquet: one row per sample keyed by ``IndexConfig.key_column``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import tarfile
from collections.abc import Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ._config import IndexConfig
from .._errors import SourceError
from ._probe import probe_lengths
from ._records import FieldLocation, ScannedSample, ShardScan, ShardSpec
from ._sources import (
    OPENAT, RECREATE_SHARD, as_source_error, cell_bytes, escapes_root, file_type, inside_root, open_beneath,
    read_whole,
)
from ._tokenizers import make_token_counter

logger = logging.getLogger(__name__)

_COMPRESSED_MAGIC = re.compile(rb"\x1f\x8b|BZh[1-9]1AY&SY|\xfd7zXZ\x00|\x28\xb5\x2f\xfd")  # gzip bz2 xz zstd
_WDS_META = re.compile(r"__[^/]*__($|/)")  # webdataset skips such members
# webdataset.tariterators.base_plus_ext's pattern, verbatim: importing webdataset imports torch,
# two seconds and hundreds of MB in every scan worker for one regular expression.
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_Items = list[tuple[FieldLocation, bytes]]
_Counter = Callable[[str], int]


def sample_digest(fields: Iterable[tuple[str, bytes]]) -> int:
    """xxh64 (unsigned 64-bit) of a sample's fields in name order: name, NUL, 8-byte length, bytes."""
    digest = xxhash.xxh64()
    for name, data in sorted(fields, key=lambda item: item[0]):
        digest.update(name.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.intdigest()


def _make_sample(url: str, key: str, items: _Items, count: _Counter, rg: int = -1, row: int = -1) -> ScannedSample:
    """Probe lengths and digest of one sample's fields (sorted by name in place)."""
    items.sort(key=lambda item: item[0].name)
    lengths = probe_lengths(items, count, url=url, key=key)
    digest = sample_digest((location.name, data) for location, data in items)
    return ScannedSample(key, tuple(location for location, _ in items), lengths, digest, rg, row)


def _add_field(url: str, key: str, items: _Items, location: FieldLocation, data: bytes) -> None:
    if any(other.name == location.name for other, _ in items):
        raise SourceError(f"{url}: sample {key!r} has field {location.name!r} twice (names are lower-cased); "
                          "rename or remove one of them", url=url, key=key)
    items.append((location, data))


def _split_name(url: str, name: str) -> tuple[str, str] | None:
    """(key, field) of a member or file path by the WebDataset convention; None to skip it."""
    if escapes_root(name):
        raise SourceError(f"{url}: member {name!r} escapes its root (absolute or '..'); {RECREATE_SHARD}", url=url)
    if not name.isascii():
        try:
            name.encode("utf-8")  # tarfile and os decode undecodable bytes to lone surrogates
        except UnicodeEncodeError:
            raise SourceError(f"{url}: member {name!r} is not valid UTF-8 (keys and field names must be); "
                              f"rename it, or {RECREATE_SHARD}", url=url) from None
    if name.rsplit("/", 1)[-1].startswith(".") or _WDS_META.match(name):
        return None
    match = _BASE_PLUS_EXT.match(name)
    key, ext = (match.group(1), match.group(2)) if match else (None, None)
    if key is None or not ext:
        logger.warning("%s: skipping %r: no extension, so no field name", url, name)
        return None
    return key, ext.lower()


_MAX_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header's own data: paths and attributes, never this large
_EXTENDED_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                   tarfile.GNUTYPE_LONGLINK)
_NO_SPARSE = "sparse members cannot be read by offset: re-create the shard without --sparse (-S)"


class _RefusedMember(Exception):
    """A tar member refused while its header is parsed, before tarfile reads what it declares."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"member {name!r} {problem}")


class _CheckedTarInfo(tarfile.TarInfo):
    """tarfile's header parsing, with what a header declares checked before tarfile acts on it.

    A GNU sparse member (type 'S', or pax ``GNU.sparse.*`` records) is refused before its
    sparse map is read: tarfile would expand its holes, reading a 10 KB shard that declares
    1.5 GB as 1.5 GB of bytes. Extended headers (pax, GNU long names) are read whole by
    tarfile: one declaring more than ``_MAX_HEADER_BYTES`` is refused before it is read.
    """

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type == tarfile.GNUTYPE_SPARSE:
            size = getattr(self, "_sparse_structs", (None, None, self.size))[2]  # the expanded size ('S' header)
            raise _RefusedMember(self.name, f"is a GNU sparse file (declaring {size} bytes); {_NO_SPARSE}")
        if self.type in _EXTENDED_TYPES and self.size > _MAX_HEADER_BYTES:
            raise _RefusedMember(self.name, f"has an extended header declaring {self.size} bytes, over "
                                            f"{_MAX_HEADER_BYTES}; {RECREATE_SHARD}")
        return super()._proc_member(tarfile_)  # type: ignore[misc]  # private in typeshed, there since Python 3.0

    def _refuse_sparse(self, next_: tarfile.TarInfo, pax_headers: dict[str, str], *_: object) -> None:
        name = pax_headers.get("GNU.sparse.name") or pax_headers.get("path") or next_.name
        size = pax_headers.get("GNU.sparse.realsize") or pax_headers.get("GNU.sparse.size") or "?"
        raise _RefusedMember(name, f"is a GNU sparse file (declaring {size} bytes); {_NO_SPARSE}")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse  # pax sparse formats 0.0, 0.1, 1.0


def _is_sparse(info: tarfile.TarInfo) -> bool:
    return info.issparse() or info.type == tarfile.GNUTYPE_SPARSE or any(
        name.startswith("GNU.sparse.") for name in info.pax_headers)


def _scan_tar(shard: ShardSpec, config: IndexConfig, count: _Counter) -> ShardScan:
    try:
        return _scan_tar_members(shard, config, count)
    except _RefusedMember as exc:
        raise SourceError(f"{shard.url}: {exc}", url=shard.url) from None


def _scan_tar_members(shard: ShardSpec, config: IndexConfig, count: _Counter) -> ShardScan:
    url = shard.url
    fs, path = url_to_fs(url)
    scan = ShardScan(shard, size_bytes=fs.size(path))
    seen: set[str] = set()
    key, items = "", list[tuple[FieldLocation, bytes]]()  # the sample being collected
    with fs.open(path, "rb") as f:
        first = f.read(tarfile.BLOCKSIZE)
        if _COMPRESSED_MAGIC.match(first):
            raise SourceError(f"{url}: compressed data, which cannot be read by offset; re-pack as plain .tar", url=url)
        if len(first) == tarfile.BLOCKSIZE and first.count(0) == tarfile.BLOCKSIZE:
            return scan  # only an end marker: an empty archive (Python 3.10's stream reader fails on it)
        f.seek(0)
        with tarfile.open(fileobj=f, mode="r|", tarinfo=_CheckedTarInfo) as tar:
            while (info := tar.next()) is not None:
                tar.members = []  # type: ignore[attr-defined]  # streaming: keep no member list (as webdataset)
                if info.isreg() and _is_sparse(info):  # this Python's tarfile parsed a sparse header we did not see
                    raise _RefusedMember(info.name, f"is a GNU sparse file (declaring {info.size} bytes); {_NO_SPARSE}")
                if info.isreg() and scan.size_bytes and info.offset_data + info.size > scan.size_bytes:
                    raise SourceError(f"{url}: member {info.name!r} declares {info.size} bytes at byte "
                                      f"{info.offset_data}, past the end of the shard ({scan.size_bytes} bytes); "
                                      f"{RECREATE_SHARD}", url=url)
                split = _split_name(url, info.name) if info.isreg() else None
                if split is None:
                    continue
                extracted = tar.extractfile(info)
                data = extracted.read() if extracted is not None else b""
                if split[0] != key:
                    if items:
                        scan.samples.append(_make_sample(url, key, items, count))
                    key, items = split[0], []
                    if key in seen:
                        raise SourceError(f"{url}: sample {key!r} appears again after other samples "
                                          f"(a sample's members must be adjacent); {RECREATE_SHARD}", url=url, key=key)
                    seen.add(key)
                location = FieldLocation(split[1], config.modality_of(split[1]), info.name, info.offset_data, info.size)
                _add_field(url, key, items, location, data)
            end = tar.offset
        f.seek(end)
        block = f.read(tarfile.BLOCKSIZE)
        if len(block) < tarfile.BLOCKSIZE or block.count(0) != tarfile.BLOCKSIZE:
            raise SourceError(f"{url}: truncated or corrupt tar (no header or end marker at byte {end}); {RECREATE_SHARD}",
                              url=url)
    if items:
        scan.samples.append(_make_sample(url, key, items, count))
    return scan


def _scan_parquet(shard: ShardSpec, config: IndexConfig, count: _Counter) -> ShardScan:
    url, key_column = shard.url, config.key_column
    fs, path = url_to_fs(url)
    scan = ShardScan(shard, size_bytes=fs.size(path))
    with fs.open(path, "rb") as f:
        table_file = pq.ParquetFile(f)
        names = table_file.schema_arrow.names
        if key_column not in names:
            raise SourceError(f"{url}: no key column {key_column!r} (columns: {', '.join(names)}); "
                              "set IndexConfig.key_column to the column holding the sample key", url=url)
        columns = [(name, name.lower()) for name in names if name != key_column]
        seen: set[str] = set()
        for rg in range(table_file.num_row_groups):
            table = table_file.read_row_group(rg)
            try:
                keys = table.column(key_column).to_pylist()
            except (ValueError, OverflowError) as exc:  # invalid UTF-8, a date out of Python's range
                raise SourceError(f"{url}: row group {rg}: column {key_column!r} holds a key that cannot be converted "
                                  f"({type(exc).__name__}: {exc}); fix column {key_column!r}", url=url) from None
            cells = {}
            for column, _ in columns:
                try:
                    cells[column] = cell_bytes(table.column(column))
                except SourceError as exc:
                    raise SourceError(f"{url}: row group {rg}: column {column!r}: {exc}; fix or drop the column",
                                      url=url) from None
            for row, raw_key in enumerate(keys):
                key = str(raw_key)
                if raw_key is None or key in seen:
                    problem = "a null key" if raw_key is None else f"key {key!r} again"
                    raise SourceError(f"{url}: row group {rg} row {row} has {problem}; fix column {key_column!r}",
                                      url=url, key=key)
                seen.add(key)
                items: _Items = []
                for column, name in columns:
                    value = cells[column][row]
                    if value is not None:
                        location = FieldLocation(name, config.modality_of(name), column, -1, len(value))
                        _add_field(url, key, items, location, value)
                scan.samples.append(_make_sample(url, key, items, count, rg, row))
    return scan


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
            split = _split_name(url, relative)
            if split is None:
                continue
            if mode == 0:
                raise SourceError(f"{url}: {relative!r} is a symbolic link to {os.path.realpath(entry.path)}, which "
                                  "does not exist; remove or fix the link", url=url)
            if not stat.S_ISREG(mode):
                logger.warning("%s: skipping %r: a %s, not a regular file (never opened)", url, relative, file_type(mode))
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
        raise SourceError(f"{url}: {relative!r} is a symbolic link to the folder {target} ({where} the folder); "
                          "linked folders are not followed: replace the link by the folder, or give "
                          f"{target} as a source of its own", url=url)
    if where == "outside":
        raise SourceError(f"{url}: {relative!r} is a symbolic link to {target}, outside the folder; copy the "
                          "file into the folder or remove the link", url=url)
    return mode


def _scan_folder(shard: ShardSpec, config: IndexConfig, count: _Counter) -> ShardScan:
    url = shard.url
    fs, root = url_to_fs(url)
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise FileNotFoundError(f"no folder {root}")
    groups: dict[str, list[tuple[str, str]]] = {}
    local = isinstance(fs, LocalFileSystem) and OPENAT
    if local:  # link loops, linked folders, FIFOs and devices handled before any file is opened
        for relative, key, name in _walk_local(url, root):
            groups.setdefault(key, []).append((name, relative))
    else:  # object stores and HTTP: no links, no special files
        for path in sorted(fs.find(root)):
            relative = path[len(root) + 1 :]
            if not path.startswith(root + "/") or any(part.startswith(".") for part in relative.split("/")):
                continue
            split = _split_name(url, relative)
            if split is not None:
                groups.setdefault(split[0], []).append((split[1], relative))
    if not groups:
        raise SourceError(f"{url}: no samples (an empty folder, or only hidden files)", url=url)
    scan = ShardScan(shard)
    for key in sorted(groups):
        items: _Items = []
        for name, relative in groups[key]:
            data = _read_local(url, root, relative) if local else fs.cat_file(f"{root}/{relative}")
            _add_field(url, key, items, FieldLocation(name, config.modality_of(name), relative, 0, len(data)), data)
            scan.size_bytes += len(data)
        scan.samples.append(_make_sample(url, key, items, count))
    return scan


def _read_local(url: str, root: str, relative: str) -> bytes:
    """A local folder file's bytes, opened as ``read_field`` opens it (no link out, no FIFO)."""
    descriptor = open_beneath(root, relative, f"{url}: {relative!r}", url)
    try:
        return read_whole(descriptor, os.fstat(descriptor).st_size)
    finally:
        os.close(descriptor)


_SCANNERS = {"tar": _scan_tar, "parquet": _scan_parquet, "folder": _scan_folder}


def scan_shard(shard: ShardSpec, config: IndexConfig) -> ShardScan:
    """Read one shard once and return its samples in shard order, with locations, lengths and digests.

    ``size_bytes`` is the tar or Parquet file size, or the total size of a folder's sample
    files. Raises SourceError naming the shard (and the key) for missing, corrupt or malformed
    input; connection errors and timeouts propagate (with a note) for the caller to retry.
    """
    count = make_token_counter(config.tokenizer)
    try:
        scan = _SCANNERS[shard.kind](shard, config, count)
    except (OSError, EOFError, tarfile.TarError, pa.ArrowException) as exc:
        error = as_source_error(exc, shard.kind, shard.url, shard.url, "check the URL")
        if error is None:
            raise
        raise error from exc
    if not scan.samples:
        raise SourceError(f"{shard.url}: no samples; {RECREATE_SHARD} or drop it from the sources", url=shard.url)
    return scan
