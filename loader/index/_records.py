"""Plain records that sources produce and the index stores: one sample, its fields, its lengths."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SourceKind = Literal["tar", "parquet", "folder", "arrow"]


@dataclass(frozen=True)
class FieldLocation:
    """Where one field of a sample lives inside its shard.

    ``name`` is the lower-cased field name (``jpg``, ``txt``, ``seg.json``);
    ``member`` is the tar member name, the file path relative to the folder, or
    the Parquet/Arrow column; ``offset``/``size`` are bytes within the shard URL for
    tar members (offset of the data, not the header), ``0``/file size for a
    folder file, ``-1``/value size for a Parquet cell, and the byte offset of the
    record batch message holding the row/value size for an Arrow cell.
    """

    name: str
    modality: str
    member: str
    offset: int
    size: int


@dataclass(frozen=True)
class SampleLengths:
    """Per-modality lengths measured at index time (0 where the sample lacks the modality)."""

    text_tokens: int = 0
    image_width: int = 0
    image_height: int = 0
    video_frames: int = 0
    video_fps: float = 0.0
    video_width: int = 0
    video_height: int = 0
    audio_seconds: float = 0.0
    audio_sample_rate: int = 0


@dataclass(frozen=True)
class ScannedSample:
    """One sample as a scan of its shard found it.

    ``row_group``/``row`` locate a Parquet row, or an Arrow row (record batch
    number, row within it) (``-1`` for other kinds);
    ``digest`` is an xxh64 of the sample's field bytes, folded into the
    index fingerprint so that changed content changes the fingerprint.
    """

    key: str
    fields: tuple[FieldLocation, ...]
    lengths: SampleLengths
    digest: int
    row_group: int = -1
    row: int = -1


@dataclass(frozen=True)
class DamagedSample:
    """A sample (or member, or row) left out of the index because it is damaged (``_damage``).

    ``file`` is the shard URL; ``key`` the sample key ('' when the damage hides it);
    ``member`` the tar member, folder file or column; ``reason`` one of ``_damage.REASONS``;
    ``error`` the one-line message naming all of these and what to do.
    """

    file: str
    key: str
    member: str
    reason: str
    error: str


@dataclass(frozen=True)
class ShardSpec:
    """One unit of scanning: a tar shard, a Parquet or Arrow file, or a folder, by fsspec URL."""

    url: str
    kind: SourceKind


@dataclass
class ShardScan:
    """The result of scanning one shard: its samples in shard order, and those left out as damaged.

    ``classes``: a folder's class names, whose positions its samples' ``label`` fields hold (``_class_folders``).
    """

    shard: ShardSpec
    samples: list[ScannedSample] = field(default_factory=list)
    size_bytes: int = 0
    damaged: list[DamagedSample] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
