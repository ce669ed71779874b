"""Arrow IPC files as sources: record batches with their byte offsets, one cell read back, saved datasets.

``datasets.Dataset.save_to_disk`` writes a folder of Arrow IPC *stream* files
(``data-00000-of-00002.arrow``, ...) with ``state.json`` (which lists them, in order) and
``dataset_info.json``. Such a folder given as a source is the listed ``.arrow`` files; a
``.arrow`` file may also be given itself, in the stream or the file format (Feather v2; its
``ARROW1`` magic is skipped).

A row is found again by the byte offset of its record batch's message (kept in the field
location's ``offset``) and its row within the batch: reading a cell back reads the schema
message at the start of the file and that one batch message, nothing else, and a local file
is memory-mapped, so only the pages of that batch are touched. A local file stays mapped, with
its schema and the batches read so far, while it is one of this process's kept files
(``_open_files``), so a cell costs a slice, not a parse. Dictionary-encoded columns
(which ``datasets`` never writes) are refused: a batch could not be read on its own.
"""

from __future__ import annotations

import json
import posixpath
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from .._errors import SourceError
from ._columns import cell_bytes, is_media_struct
from ._open_files import SOURCE_FILES, OpenedFile, local_path
from ._records import FieldLocation

_FILE_MAGIC = b"ARROW1"
_STATE = "state.json"
_DATASET_DICT = "dataset_dict.json"
_CHANGED = "the source changed since it was indexed: restore it or re-run `omnifeed index`"


@contextmanager
def _opened(url: str) -> Iterator[Any]:
    """The file at ``url`` as a pyarrow input: memory-mapped when local, a buffered fsspec file otherwise."""
    fs, path = url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        source = pa.memory_map(path, "r")
        try:
            yield source
        finally:
            source.close()
        return
    with fs.open(path, "rb") as f:
        yield pa.PythonFile(f, mode="r")


def _stream_start(source: Any) -> int:
    """Where the message stream starts: after the magic of the IPC file format, else at 0."""
    source.seek(0)
    return 8 if source.read(len(_FILE_MAGIC)) == _FILE_MAGIC else 0


def _schema_at(source: Any, url: str) -> pa.Schema:
    source.seek(_stream_start(source))
    message = pa.ipc.read_message(source)
    if message.type != "schema":
        raise SourceError(
            f"{url}: not an Arrow IPC file (its first message is a {message.type}, not the schema); "
            "re-write it (datasets: save_to_disk)",
            url=url,
        )
    schema = pa.ipc.read_schema(message)
    dictionaries = [f.name for f in schema if pa.types.is_dictionary(f.type)]
    if dictionaries:
        raise SourceError(
            f"{url}: dictionary-encoded columns ({', '.join(dictionaries)}) cannot be read back by row; "
            "re-write the file without dictionary encoding (e.g. cast them to their value type)",
            url=url,
        )
    return schema


def arrow_schema(url: str) -> pa.Schema:
    """The schema of the Arrow IPC file at ``url`` (its first message only)."""
    with _opened(url) as source:
        return _schema_at(source, url)


def arrow_batches(url: str) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(byte offset of the batch's message, record batch) for each record batch of the file, in order."""
    with _opened(url) as source:
        schema = _schema_at(source, url)
        reader = pa.ipc.MessageReader.open_stream(source)
        while True:
            offset = source.tell()
            try:
                message = reader.read_next_message()
            except StopIteration:
                return
            if message.type != "record batch":
                raise SourceError(
                    f"{url}: a {message.type} message at byte {offset} (only record batches are read); "
                    "re-write the file without dictionary encoding",
                    url=url,
                )
            batch = pa.ipc.read_record_batch(message, schema)
            batch.validate(full=True)
            yield offset, batch


_BATCHES_KEPT = 4096  # record batches kept per local file: zero-copy over its mapping, no memory of their own


def _kept_batch(opened: OpenedFile, url: str, offset: int) -> pa.RecordBatch:
    """The record batch whose message is at ``offset`` of a kept local file (its schema and batches parsed once)."""
    schema = opened.state.get("arrow_schema")
    if schema is None:
        schema = _schema_at(pa.BufferReader(opened.mapped()), url)
        with opened.lock:
            schema = opened.state.setdefault("arrow_schema", schema)
            opened.state.setdefault("arrow_batches", {})
    batches: dict[int, pa.RecordBatch] = opened.state["arrow_batches"]
    batch = batches.get(offset)
    if batch is None:
        if not 0 <= offset < opened.size:
            raise SourceError(
                f"{url}: no record batch at byte {offset} (the file has {opened.size:,} bytes); {_CHANGED}", url=url
            )
        source = pa.BufferReader(opened.mapped())
        source.seek(offset)
        batch = _batch_at(source, schema, url, offset)
        with opened.lock:
            if len(batches) >= _BATCHES_KEPT:
                batches.clear()
            batches[offset] = batch
    return batch


def _batch_at(source: Any, schema: pa.Schema, url: str, offset: int) -> pa.RecordBatch:
    message = pa.ipc.read_message(source)
    if message.type != "record batch":
        raise SourceError(f"{url}: no record batch at byte {offset}; {_CHANGED}", url=url)
    return pa.ipc.read_record_batch(message, schema)


_WIDE = (pa.large_binary(), pa.large_string())


def _read_from_file(opened: OpenedFile, values: pa.Array) -> bytes | None:
    """A binary or string cell (a media struct's ``bytes``) held in the file's mapping, read with one ranged read.

    Copying it out of the mapping instead faulted its pages in one by one: the Arrow epoch ran at
    0.90x tar against 0.97x this way (benchmarks/RESULTS.md). None when it is not such a cell.
    """
    cell = values.field("bytes") if is_media_struct(values.type) else values
    if values.null_count or cell.null_count or cell.type not in (pa.binary(), pa.string(), *_WIDE):
        return None
    _, offsets, data = cell.buffers()
    if offsets is None or data is None:
        return None
    width = 8 if cell.type in _WIDE else 4
    start, end = struct.unpack_from("<2q" if width == 8 else "<2i", offsets, cell.offset * width)
    mapped = opened.mapped()
    at = data.address - mapped.address + start
    if not (0 <= start <= end and 0 <= at and at + end - start <= mapped.size):
        return None  # not in the mapping (Arrow copied the buffer): sliced from memory instead
    return opened.read(at, end - start)


def read_arrow_cell(url: str, field: FieldLocation, row: int) -> bytes | None:
    """One cell's field bytes: the batch message at ``field.offset``, its column ``field.member``, row ``row``.

    A local file is kept memory-mapped with its schema and the batches read so far (``_open_files``:
    opened again when the path names another file); another URL is opened for each read.
    """
    if field.offset < 0 or row < 0:
        raise ValueError(f"{url}: reading Arrow field {field.name!r} needs its batch offset and row=")
    if local_path(url) is not None:
        with SOURCE_FILES.use(url) as opened:
            batch = _kept_batch(opened, url, field.offset)
            column = batch.schema.get_field_index(field.member)
            if 0 <= column and 0 <= row < batch.num_rows:
                values = batch.column(column).slice(row, 1)
                values.validate(full=True)
                read = _read_from_file(opened, values)
                if read is not None:
                    return read
    else:
        with _opened(url) as source:
            schema = _schema_at(source, url)
            source.seek(field.offset)
            batch = _batch_at(source, schema, url, field.offset)
    column = batch.schema.get_field_index(field.member)
    if column < 0 or row >= batch.num_rows:
        return None
    values = batch.column(column).slice(row, 1)
    values.validate(full=True)
    try:
        return cell_bytes(values)[0]
    except SourceError as exc:
        raise SourceError(
            f"{url}: column {field.member!r} row {row} of the batch at byte {field.offset}: {exc}", url=url
        ) from None


def saved_dataset_files(fs: Any, folder: str, spec: str) -> list[str] | None:
    """The Arrow files of a folder written by ``datasets``' ``save_to_disk``, in order; None for another folder.

    Raises SourceError for a ``DatasetDict`` folder (one split at a time) and for a ``state.json``
    naming files outside the folder or missing.
    """
    folder = folder.rstrip("/")
    if fs.isfile(f"{folder}/{_DATASET_DICT}"):
        try:
            splits = json.loads(_read_small(fs, f"{folder}/{_DATASET_DICT}", spec)).get("splits", [])
        except (ValueError, AttributeError):
            splits = []
        shown = ", ".join(f"{folder}/{s}" for s in splits[:3]) if isinstance(splits, list) else ""
        raise SourceError(
            f"{spec}: a DatasetDict saved by datasets; index one split's folder at a time ({shown})", url=spec
        )
    if not fs.isfile(f"{folder}/{_STATE}"):
        return None
    try:
        state = json.loads(_read_small(fs, f"{folder}/{_STATE}", spec))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError):
        return None  # a state.json of something else: the folder is a WebDataset-style folder
    files = []
    for name in names:
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise SourceError(
                f"{spec}: {_STATE} names {name!r}, not a file of the folder; re-save the dataset", url=spec
            )
        path = posixpath.join(folder, name)
        if not fs.isfile(path):
            raise SourceError(f"{spec}: {_STATE} lists {name}, which does not exist; re-save the dataset", url=spec)
        files.append(path)
    return files or None


def _read_small(fs: Any, path: str, spec: str, limit: int = 1 << 20) -> bytes:
    with fs.open(path, "rb") as f:
        data: bytes = f.read(limit + 1)
    if len(data) > limit:
        raise SourceError(f"{spec}: {path} is over {limit} bytes, too large for a datasets metadata file", url=spec)
    return data
