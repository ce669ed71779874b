"""Scanning one shard into ScannedSample records: keys, field locations, lengths, digests.

WebDataset conventions for tar shards (``_names``): a sample's key is the member path up to the
first dot of its basename, the rest (lower-cased) its field; a tar sample's members are adjacent.
Folders: ``_folder_scan``. Parquet and Arrow files: one row per sample (``_table_scan``). A damaged sample
is left out and named, the rest of the shard indexed (``_damage``; all of it refused when strict).
"""

from __future__ import annotations

import logging
import re
import tarfile
from collections.abc import Callable
from typing import Any

import pyarrow as pa
from fsspec.core import url_to_fs

from .._errors import SourceError
from ._config import IndexConfig
from ._damage import Damage
from ._folder_scan import scan_folder
from ._names import split_name
from ._probe import FieldProbeError
from ._records import FieldLocation, ShardScan, ShardSpec
from ._samples import FieldTwice, Items, add_field, make_sample
from ._sources import RECREATE_SHARD, as_source_error
from ._table_scan import scan_arrow, scan_parquet
from ._tokenizers import TokenCounter, make_token_counter

logger = logging.getLogger(__name__)

_COMPRESSED_MAGIC = re.compile(rb"\x1f\x8b|BZh[1-9]1AY&SY|\xfd7zXZ\x00|\x28\xb5\x2f\xfd")  # gzip bz2 xz zstd
_MAX_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header's own data: paths and attributes, never this large
_MAX_HEADER_CHAIN = 16  # extended headers before one member (tar writes at most a few); tarfile recurses per header
_EXTENDED_TYPES = (
    tarfile.XHDTYPE,
    tarfile.XGLTYPE,
    tarfile.SOLARIS_XHDTYPE,
    tarfile.GNUTYPE_LONGNAME,
    tarfile.GNUTYPE_LONGLINK,
)
_NO_SPARSE = "sparse members cannot be read by offset: re-create the shard without --sparse (-S)"


class _RefusedMember(Exception):
    """A tar member refused while its header is parsed, before tarfile reads what it declares."""

    def __init__(self, name: str, problem: str, reason: str) -> None:
        super().__init__(f"member {name!r} {problem}")
        self.name, self.reason = name, reason


class _CheckedTarInfo(tarfile.TarInfo):
    """tarfile's header parsing, with what a header declares checked before tarfile acts on it.

    A GNU sparse member (type 'S', or pax ``GNU.sparse.*`` records) is refused before its
    sparse map is read: tarfile would expand its holes, reading a 10 KB shard that declares
    1.5 GB as 1.5 GB of bytes. Extended headers (pax, GNU long names) are read whole by
    tarfile: one declaring more than ``_MAX_HEADER_BYTES`` is refused before it is read, and
    more than ``_MAX_HEADER_CHAIN`` in a row (tarfile recurses once per header) too.
    """

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type == tarfile.GNUTYPE_SPARSE:
            size = getattr(self, "_sparse_structs", (None, None, self.size))[2]  # the expanded size ('S' header)
            raise _RefusedMember(self.name, f"is a GNU sparse file (declaring {size} bytes); {_NO_SPARSE}", "sparse")
        if self.type not in _EXTENDED_TYPES:
            return super()._proc_member(tarfile_)  # type: ignore[misc]  # private in typeshed, there since Python 3.0
        if self.size > _MAX_HEADER_BYTES:
            raise _RefusedMember(
                self.name,
                f"has an extended header declaring {self.size} bytes, over {_MAX_HEADER_BYTES}; {RECREATE_SHARD}",
                "oversized_header",
            )
        depth = getattr(tarfile_, "_omnifeed_headers", 0)  # tarfile reads the member after it by recursing
        if depth >= _MAX_HEADER_CHAIN:
            raise _RefusedMember(
                self.name,
                f"follows {depth} extended headers in a row (at most {_MAX_HEADER_CHAIN} "
                f"before one member); {RECREATE_SHARD}",
                "oversized_header",
            )
        tarfile_._omnifeed_headers = depth + 1  # type: ignore[attr-defined]
        try:
            return super()._proc_member(tarfile_)  # type: ignore[misc]
        finally:
            tarfile_._omnifeed_headers = depth  # type: ignore[attr-defined]

    def _refuse_sparse(self, next_: tarfile.TarInfo, headers: Any, *_: object) -> None:
        # tarfile passes the pax records as a dict, or (format 0.0, since the 2025 pax fixes, e.g. Debian's 3.11.2)
        # as a list of raw (length, keyword, value) records
        pax_headers = (
            headers
            if isinstance(headers, dict)
            else {keyword.decode("utf-8", "replace"): value.decode("utf-8", "replace") for _, keyword, value in headers}
        )
        name = pax_headers.get("GNU.sparse.name") or pax_headers.get("path") or next_.name
        size = pax_headers.get("GNU.sparse.realsize") or pax_headers.get("GNU.sparse.size") or "?"
        raise _RefusedMember(name, f"is a GNU sparse file (declaring {size} bytes); {_NO_SPARSE}", "sparse")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse  # pax sparse formats 0.0, 0.1, 1.0


def _is_sparse(info: tarfile.TarInfo) -> bool:
    return (
        info.issparse()
        or info.type == tarfile.GNUTYPE_SPARSE
        or any(name.startswith("GNU.sparse.") for name in info.pax_headers)
    )


class _Broken(Exception):
    """The tar cannot be read past this point: the member there ('' if unknown), a damage reason, the error."""

    def __init__(self, member: str, reason: str, error: str) -> None:
        super().__init__(error)
        self.member, self.reason = member, reason


class _TarSamples:
    """A tar's members, in order, into samples (runs of adjacent members sharing a key); damaged ones left out."""

    def __init__(self, url: str, config: IndexConfig, count: TokenCounter, scan: ShardScan, damage: Damage) -> None:
        self.url, self.config, self.count, self.scan, self.damage = url, config, count, scan, damage
        self.key = ""
        self.items: Items = []
        self.problem: tuple[str, str, str] | None = None  # (member, reason, error) damaging the sample being read
        self.seen: set[str] = set()

    def member(self, name: str, offset: int, size: int, data: bytes, key: str, field: str) -> None:
        """One regular member that names a field: added to its sample, which ends when the key changes."""
        if key != self.key:
            self._end_sample()
            self.key, self.items, self.problem = key, [], None
            if key in self.seen:
                self.problem = (
                    name,
                    "not_adjacent",
                    f"{self.url}: sample {key!r} appears again after other samples "
                    f"(a sample's members must be adjacent): its later members are left out, the first "
                    f"are indexed; {RECREATE_SHARD}",
                )
            self.seen.add(key)
        if self.problem is None:
            try:
                add_field(
                    self.url,
                    key,
                    self.items,
                    FieldLocation(field, self.config.modality_of(field), name, offset, size),
                    data,
                )
            except FieldTwice as exc:
                self.problem = (name, "field_twice", str(exc))

    def _end_sample(self) -> None:
        if self.problem is not None:
            self.damage.add(self.key, *self.problem)
        elif self.items:
            try:
                self.scan.samples.append(make_sample(self.url, self.key, self.items, self.count))
            except FieldProbeError as exc:
                self.damage.add(self.key, exc.member, exc.reason, str(exc))
        self.items, self.problem = [], None

    def end(self) -> None:
        """The tar ended well: its last sample is complete."""
        self._end_sample()

    def broken(self, exc: _Broken) -> None:
        """The tar is unreadable from here: the sample being read (maybe incomplete) and the rest are left out.

        SourceError (the shard refused) when nothing was read before the break.
        """
        if not self.scan.samples and not self.items and not self.damage.samples:
            raise SourceError(str(exc), url=self.url)
        before = len(self.scan.samples)
        being_read = f"sample {self.key!r} (perhaps incomplete) and " if self.items else ""
        left_out = (
            f"the {before} sample{'s' if before != 1 else ''} before it are indexed, {being_read}the rest of "
            "the shard are left out"
        )
        self.damage.add(self.key if self.items else "", exc.member, exc.reason, str(exc), left_out)


def _scan_tar(shard: ShardSpec, config: IndexConfig, count: TokenCounter) -> ShardScan:
    url = shard.url
    fs, path = url_to_fs(url)
    scan = ShardScan(shard, size_bytes=fs.size(path))
    damage = Damage(url, config.strict)
    samples = _TarSamples(url, config, count, scan, damage)
    with fs.open(path, "rb") as f:
        first = f.read(tarfile.BLOCKSIZE)
        if _COMPRESSED_MAGIC.match(first):
            raise SourceError(f"{url}: compressed data, which cannot be read by offset; re-pack as plain .tar", url=url)
        if len(first) == tarfile.BLOCKSIZE and first.count(0) == tarfile.BLOCKSIZE:
            return scan  # only an end marker: an empty archive (Python 3.10's stream reader fails on it)
        f.seek(0)
        try:
            end = _read_members(f, url, scan.size_bytes, samples)
            f.seek(end)
            block = f.read(tarfile.BLOCKSIZE)
            if len(block) < tarfile.BLOCKSIZE or block.count(0) != tarfile.BLOCKSIZE:
                raise _Broken(
                    "",
                    "truncated",
                    f"{url}: truncated or corrupt tar (no header or end marker at byte {end}); {RECREATE_SHARD}",
                )
        except _Broken as exc:
            samples.broken(exc)
        else:
            samples.end()
    return damage.finish(scan)


def _read_members(f: Any, url: str, size: int, samples: _TarSamples) -> int:
    """Every member of the open tar ``f`` to ``samples``; the offset after the last.

    Raises _Broken where the tar stops being readable.
    """
    tar: tarfile.TarFile | None = None
    try:
        with tarfile.open(fileobj=f, mode="r|", tarinfo=_CheckedTarInfo) as tar:
            while (info := tar.next()) is not None:
                tar.members = []  # type: ignore[attr-defined]  # streaming: keep no member list (as webdataset)
                if info.isreg() and _is_sparse(info):  # this Python's tarfile parsed a sparse header we did not see
                    raise _RefusedMember(
                        info.name, f"is a GNU sparse file (declaring {info.size} bytes); {_NO_SPARSE}", "sparse"
                    )
                if info.isreg() and size and info.offset_data + info.size > size:
                    raise _Broken(
                        info.name,
                        "truncated",
                        f"{url}: member {info.name!r} declares {info.size} bytes "
                        f"at byte {info.offset_data}, past the end of the shard ({size} bytes); "
                        f"{RECREATE_SHARD}",
                    )
                if size and tar.offset > size:  # any type tarfile skips by its size (an unknown one, a pax size)
                    raise _Broken(
                        info.name,
                        "truncated",
                        f"{url}: member {info.name!r} (type "
                        f"{info.type.decode('latin-1')!r}) declares data up to byte {tar.offset}, past the "
                        f"end of the shard ({size} bytes); {RECREATE_SHARD}",
                    )
                split = split_name(url, info.name) if info.isreg() else None
                if split is None:
                    continue
                extracted = tar.extractfile(info)
                data = extracted.read() if extracted is not None else b""
                samples.member(info.name, info.offset_data, info.size, data, *split)
            return tar.offset
    except _RefusedMember as exc:
        raise _Broken(exc.name, exc.reason, f"{url}: {exc}") from None
    except (tarfile.TarError, EOFError) as exc:
        where = f" at byte {tar.offset}" if tar is not None and tar.offset else ""
        raise _Broken("", "truncated", f"{url}: truncated or corrupt tar{where} ({exc}); {RECREATE_SHARD}") from None


_SCANNERS: dict[str, Callable[[ShardSpec, IndexConfig, TokenCounter], ShardScan]] = {
    "tar": _scan_tar,
    "parquet": scan_parquet,
    "arrow": scan_arrow,
    "folder": scan_folder,
}


def scan_shard(shard: ShardSpec, config: IndexConfig) -> ShardScan:
    """Read one shard once and return its samples in shard order, with locations, lengths and digests.

    ``size_bytes`` is the tar, Parquet or Arrow file size, or the total size of a folder's
    sample files. Damaged samples are left out and listed in ``damaged`` (``_damage``); with
    ``config.strict`` the first one raises SourceError instead. Raises SourceError naming the
    shard (and the key) for missing, corrupt or malformed input, and ``ShardDamaged`` (a
    SourceError listing them) when every sample is damaged; connection errors and timeouts
    propagate (with a note) for the caller to retry.
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
