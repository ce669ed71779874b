"""Columns of table sources (Parquet, Arrow): each column's modality, and its cells as field bytes.

A column's modality, the first rule that applies:

1. ``IndexConfig.modalities`` names it (its lower-cased name, or its last extension);
2. its Hugging Face feature (the ``huggingface`` key of the Arrow schema metadata, which
   ``datasets`` writes into Parquet and Arrow files): ``Image`` → image, ``Audio`` → audio,
   ``Video`` → video, ``ClassLabel`` → meta (a label);
3. its name's last extension has a default (``jpg`` → image, ``flac`` → audio, ``txt``/``text``
   → text, ...: ``IndexConfig.modality_of``);
4. a string column named like text (``TEXT_NAMES``: ``caption``, ``sentence``, ...) → text;
5. a binary column or a media struct (a struct with a binary ``bytes`` member, as ``datasets``
   stores images and audio: ``struct<bytes: binary, path: string>``) named like a medium
   (``MEDIA_NAMES``) → that medium; any other is **typed cell by cell**, since one column may hold
   several media (JPEG rows and FLAC rows). A cell's modality, the first that applies:
   a. its companion extension column, when the table has one (a string column ``<column>_ext``,
      ``<column>_extension`` or ``<column>_format``, or ``ext``, ``extension``, ``format`` when this
      is the only such column), holding an extension (``jpg``, ``.flac``) or a MIME type
      (``audio/flac``) that names a modality, as a tar member's extension does;
   b. its magic bytes (JPEG, PNG, GIF, WebP, TIFF → image; FLAC, WAV, Ogg, MP3, M4A → audio; MP4,
      WebM/Matroska, AVI → video), when the column is a media column: at least half its first
      non-null cells (up to ``SNIFF_CELLS``) are media, or it has a companion. A column of other
      blobs stays meta whole: 2- or 3-byte signatures (MP3's) turn up in random bytes;
   c. the column's default: the medium most of those first cells have (meta when it is no media
      column).
   A cell whose medium another field of its row already has stays meta (a second image, a mask:
   the feed decodes one field per modality, and meta carries the bytes); a column placed by rules
   1-5 holds its medium in every row. So a sample is damaged (``header``) only when its bytes are
   unreadable as the medium they are, never because its neighbours hold another one;
6. anything else → meta (an int or ``ClassLabel`` column is a label: an int64 tensor in the batch).

A cell's field bytes: binary as is; a string as stored (UTF-8); a media struct's ``bytes``
member; anything else as JSON text. A media struct cell whose ``bytes`` is null but whose
``path`` is set is damaged (``no_bytes``): the path names a file outside the dataset (often on
the machine that wrote it), which omnifeed does not read.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .._errors import SourceError
from ._config import IndexConfig

BINARY_TYPES = ("binary", "large_binary", "fixed_size_binary", "binary_view")  # pyarrow.types.is_*
STRING_TYPES = {"string": "binary", "large_string": "large_binary", "string_view": "binary_view"}  # its binary twin
TEXT_NAMES = frozenset({"text", "txt", "caption", "sentence", "transcription", "transcript", "prompt", "utterance"})
MEDIA_NAMES = {"image": "image", "img": "image", "audio": "audio", "video": "video"}
HF_MODALITIES = {"Image": "image", "Audio": "audio", "Video": "video", "ClassLabel": "meta"}
SNIFF_CELLS = 8
MEDIA = ("image", "audio", "video")
COMPANION_SUFFIXES = ("_ext", "_extension", "_format")
COMPANION_NAMES = ("ext", "extension", "format")


def _is(arrow_type: pa.DataType, names: Any) -> bool:
    return any(getattr(pa.types, f"is_{name}", lambda _: False)(arrow_type) for name in names)


def is_media_struct(arrow_type: pa.DataType) -> bool:
    """Whether a column holds media as ``datasets`` stores it: a struct with a binary ``bytes`` member."""
    if not pa.types.is_struct(arrow_type) or arrow_type.get_field_index("bytes") < 0:
        return False
    return _is(arrow_type.field("bytes").type, BINARY_TYPES)


def cell_kind(arrow_type: pa.DataType) -> str:
    """How a cell of ``arrow_type`` is stored as field bytes: 'binary', 'string' or 'json'."""
    if _is(arrow_type, BINARY_TYPES) or is_media_struct(arrow_type):
        return "binary"
    return "string" if _is(arrow_type, STRING_TYPES) else "json"


def cell_bytes(column: pa.ChunkedArray | pa.Array) -> list[bytes | None]:
    """A column's cells as field bytes (module docstring); SourceError for a value Python cannot hold."""
    if is_media_struct(column.type):
        return pc.struct_field(column, "bytes").to_pylist()  # type: ignore[no-any-return]
    if _is(column.type, BINARY_TYPES):
        return column.to_pylist()  # type: ignore[no-any-return]
    for name, twin in STRING_TYPES.items():
        if getattr(pa.types, f"is_{name}", lambda _: False)(column.type):
            return column.cast(getattr(pa, twin)()).to_pylist()  # type: ignore[no-any-return]  # even invalid UTF-8
    try:
        values = column.to_pylist()
    except (ValueError, OverflowError) as exc:  # dates out of Python's range, invalid UTF-8 inside nested values
        raise SourceError(f"a {column.type} value cannot be converted ({type(exc).__name__}: {exc})") from None
    return [None if v is None else json.dumps(v, default=str).encode("utf-8") for v in values]


def cell_paths(column: pa.ChunkedArray | pa.Array) -> list[str | None] | None:
    """A media struct column's ``path`` members (None for other columns or a struct without one)."""
    if not is_media_struct(column.type) or column.type.get_field_index("path") < 0:
        return None
    paths = pc.struct_field(column, "path")
    if not _is(paths.type, STRING_TYPES):
        return None
    return paths.cast(pa.string()).to_pylist()  # type: ignore[no-any-return]


def hf_features(schema: pa.Schema) -> dict[str, Any]:
    """Column → Hugging Face feature (a dict with ``_type``) from the schema's ``huggingface`` metadata; {} if none."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        features = json.loads(raw).get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def sniff(data: bytes) -> str | None:
    """The modality a value's magic bytes say (image, audio, video), or None."""
    head = bytes(data[:16])
    if head.startswith((b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"II*\0", b"MM\0*")):
        return "image"
    if head.startswith(b"RIFF") and len(head) >= 12:
        return {b"WEBP": "image", b"WAVE": "audio", b"AVI ": "video"}.get(head[8:12])
    if head.startswith((b"fLaC", b"OggS", b"ID3")) or head[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "audio"
    if head[4:8] == b"ftyp":
        return "audio" if head[8:11] == b"M4A" else "video"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "video"
    return None


class ColumnModalities:
    """The modality of each column of one table file, and of each cell of the columns typed cell by cell.

    Columns placed by rules 1-4 or by a medium's name have one modality for every row. Other binary
    and media-struct columns are typed cell by cell (module docstring, rule 5); their default (what a
    cell neither its companion nor its magic bytes place gets) is sniffed at the first row group (or
    record batch) holding a non-null value of them.
    """

    def __init__(self, schema: pa.Schema, columns: list[str], config: IndexConfig) -> None:
        features = hf_features(schema)
        self.columns, self.config = columns, config
        self.modality: dict[str, str] = {}  # the placed columns, and the per-cell columns' defaults decided so far
        self.per_cell: list[str] = []  # in the file's order
        for column in columns:
            decided = _by_name_and_type(column, schema.field(column).type, features.get(column), config)
            if decided is None:
                self.per_cell.append(column)
            else:
                self.modality[column] = decided
        self.placed_media = {m for m in self.modality.values() if m in MEDIA}
        by_lower = {c.lower(): c for c in columns if _is(schema.field(c).type, STRING_TYPES)}
        self.companion = {c: _companion(c, by_lower, len(self.per_cell) == 1) for c in self.per_cell}

    def decide(self, cells: Mapping[str, list[bytes | None]]) -> None:
        """Sniff the per-cell columns' defaults from their first non-null ``cells`` (a row group's)."""
        for column in [c for c in self.per_cell if c not in self.modality]:
            found = [v for v in cells[column][: 4 * SNIFF_CELLS] if v is not None][:SNIFF_CELLS]
            if found:  # a media column when at least half its first cells are media
                votes = Counter(m for m in map(sniff, found) if m is not None)
                media = votes.most_common(1)[0][0] if 2 * sum(votes.values()) >= len(found) else "meta"
                self.modality[column] = media

    def of_rows(self, cells: Mapping[str, list[bytes | None]]) -> dict[str, list[str]]:
        """Each column's modality in each row of ``cells`` (one chunk's); call `decide` on the chunk first."""
        rows = len(next(iter(cells.values()))) if cells else 0
        out = {c: [self.modality[c]] * rows for c in self.columns if c not in self.per_cell}
        for number, column in enumerate(self.per_cell):
            default = self.modality.get(column, "meta")
            companion = self.companion[column]
            exts = cells[companion] if companion is not None else [None] * rows
            earlier = [out[c] for c in self.per_cell[:number]]
            kinds = []
            for row, (value, ext) in enumerate(zip(cells[column], exts)):
                kind = "meta" if value is None else self._cell(value, ext, default, companion is not None)
                if kind in MEDIA and (kind in self.placed_media or any(e[row] == kind for e in earlier)):
                    kind = "meta"  # a second field of a medium stays meta: the feed decodes one field per modality
                kinds.append(kind)
            out[column] = kinds
        return out

    def _cell(self, value: bytes, ext: bytes | None, default: str, has_companion: bool) -> str:
        """One cell's modality: its companion's extension, else its magic bytes (in a media column), else the
        default."""
        if ext is not None:
            named = _extension_modality(ext.decode("utf-8", "replace"), self.config)
            if named is not None:
                return named
        if default in MEDIA or has_companion:  # a blob column's cells are never sniffed one by one
            return sniff(value) or default
        return default


def _companion(column: str, strings: Mapping[str, str], alone: bool) -> str | None:
    """The string column naming ``column``'s cells' extensions: ``<column>_ext``/``_extension``/``_format``, or
    (``alone``: the only column typed cell by cell) ``ext``/``extension``/``format``; None if none."""
    names = [column.lower() + suffix for suffix in COMPANION_SUFFIXES] + (list(COMPANION_NAMES) if alone else [])
    return next((strings[name] for name in names if name in strings), None)


def _extension_modality(ext: str, config: IndexConfig) -> str | None:
    """The modality an extension (``jpg``, ``.FLAC``) or MIME type (``audio/flac``) names; None when it names none."""
    name = ext.strip().lower().lstrip(".")
    if "/" in name:
        top = name.split("/", 1)[0]
        return top if top in (*MEDIA, "text") else None
    explicit = config.explicit_modality(name)
    if explicit is not None:
        return explicit
    by_default = config.modality_of(name) if name else "meta"
    return None if by_default == "meta" else by_default


def _by_name_and_type(column: str, arrow_type: pa.DataType, feature: Any, config: IndexConfig) -> str | None:
    """Rules 1-6 of the module docstring but sniffing: a modality, or None when the content must say."""
    name = column.lower()
    explicit = config.explicit_modality(name)
    if explicit is not None:
        return explicit
    if isinstance(feature, dict) and feature.get("_type") in HF_MODALITIES:
        return HF_MODALITIES[feature["_type"]]
    by_extension = config.modality_of(name)
    if by_extension != "meta":
        return by_extension
    if _is(arrow_type, STRING_TYPES):
        return "text" if name in TEXT_NAMES else "meta"
    if _is(arrow_type, BINARY_TYPES) or is_media_struct(arrow_type):
        return MEDIA_NAMES.get(name)
    return "meta"
