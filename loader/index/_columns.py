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
   (``MEDIA_NAMES``) → that medium; otherwise its first non-null cells (up to ``SNIFF_CELLS``)
   are sniffed by their magic bytes (JPEG, PNG, GIF, WebP, TIFF → image; FLAC, WAV, Ogg, MP3,
   M4A → audio; MP4, WebM/Matroska, AVI → video) and the most common answer wins, unless an earlier
   column already has that modality (a second image column, a mask, stays meta: the feed decodes
   one field per modality, and meta carries the bytes);
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
    """The modality of each column of one table file (module docstring), decided once per file.

    A column left to sniffing is decided at the first row group (or record batch) holding a
    non-null value of it.
    """

    def __init__(self, schema: pa.Schema, columns: list[str], config: IndexConfig) -> None:
        features = hf_features(schema)
        self.columns = columns
        self.modality: dict[str, str] = {}  # the columns decided so far
        for column in columns:
            decided = _by_name_and_type(column, schema.field(column).type, features.get(column), config)
            if decided is not None:
                self.modality[column] = decided

    def decide(self, cells: Mapping[str, list[bytes | None]]) -> None:
        """Sniff the undecided columns' first non-null ``cells`` (a row group's); still undecided if all null."""
        for column in [c for c in self.columns if c not in self.modality]:  # in the file's order
            found = [v for v in cells[column][: 4 * SNIFF_CELLS] if v is not None][:SNIFF_CELLS]
            if not found:
                continue
            votes = Counter(m for m in map(sniff, found) if m is not None)
            sniffed = votes.most_common(1)[0][0] if votes else "meta"
            # a second column of a medium stays meta (its bytes): the feed decodes one field per modality
            self.modality[column] = "meta" if sniffed in self.modality.values() else sniffed

    def of(self, column: str) -> str:
        """The column's modality (meta while undecided: its cells are all null so far)."""
        return self.modality.get(column, "meta")


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
