"""Scanning one shard into ScannedSample records: keys, field locations, lengths, digests.

WebDataset conventions for tar shards and folders: a sample's key is the member path up
to the first dot of its basename, the rest (lower-cased) its field; a tar sample's members
are adjacent. Parquet: one row per sample keyed by ``IndexConfig.key_column``.
"""

from __future__ import annotations

import logging
import re
import tarfile
from collections.abc import Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash
from fsspec.core import url_to_fs

from ._config import IndexConfig
from ._errors import SourceError
from ._probe import probe_lengths
from ._records import FieldLocation, ScannedSample, ShardScan, ShardSpec
from ._sources import RECREATE_SHARD, as_source_error, cell_bytes, escapes_root, link_outside
from ._text import make_token_counter

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


def _scan_tar(shard: ShardSpec, config: IndexConfig, count: _Counter) -> ShardScan:
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
        with tarfile.open(fileobj=f, mode="r|") as tar:
            while (info := tar.next()) is not None:
                tar.members = []  # type: ignore[attr-defined]  # streaming: keep no member list (as webdataset)
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


def _scan_folder(shard: ShardSpec, config: IndexConfig, count: _Counter) -> ShardScan:
    url = shard.url
    fs, root = url_to_fs(url)
    root = root.rstrip("/")
    if not fs.isdir(root):
        raise FileNotFoundError(f"no folder {root}")
    groups: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(fs.find(root)):
        relative = path[len(root) + 1 :]
        if not path.startswith(root + "/") or any(part.startswith(".") for part in relative.split("/")):
            continue
        split = _split_name(url, relative)
        if split is not None:
            target = link_outside(fs, root, relative)
            if target is not None:
                raise SourceError(f"{url}: {relative!r} is a symbolic link to {target}, outside the folder; copy the "
                                  "file into the folder or remove the link", url=url)
            groups.setdefault(split[0], []).append((split[1], relative))
    if not groups:
        raise SourceError(f"{url}: no samples (an empty folder, or only hidden files)", url=url)
    scan = ShardScan(shard)
    for key in sorted(groups):
        items: _Items = []
        for name, relative in groups[key]:
            data = fs.cat_file(f"{root}/{relative}")
            _add_field(url, key, items, FieldLocation(name, config.modality_of(name), relative, 0, len(data)), data)
            scan.size_bytes += len(data)
        scan.samples.append(_make_sample(url, key, items, count))
    return scan


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
