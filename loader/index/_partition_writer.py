"""Writing the index files from scanned rows: partitions, the by-shard order, the shard table, the manifest.

Rows arrive shard by shard in any order. `PartitionSpill` routes each to its partition by
``xxh64(utf-8 key) % partitions`` and appends it to that partition's Arrow stream file, so
memory stays one shard deep. `write_index_files` then takes the partitions one at a time:
sorts by key, keeps the first of rows sharing a key (each duplicate reported), writes the
Parquet partition and its mapped Arrow copy, and finally ``by_shard.npy``, ``shards.parquet``
and ``manifest.json`` with counts, length statistics and the fingerprint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from .._errors import SourceError
from ._config import IndexConfig
from ._damage import DAMAGED_FILE, damage_summary
from ._length_rows import write_length_files
from ._mapped_rows import write_arrow_partition
from ._records import ShardSpec
from ._sample_index import (
    BY_SHARD,
    INDEX_FORMAT,
    LENGTH_COLUMNS,
    MANIFEST,
    ROW_SCHEMA,
    SHARDS,
    partition_file,
)

_ROW_GROUP_ROWS = 65536
_STAT_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


@dataclass
class IndexReport:
    """What `build_index` did: where the index is, its size and fingerprint, what failed, what was left out.

    ``errors``: shards refused and keys found twice (``source``, ``error``, maybe ``key``);
    ``damaged``: every sample left out as damaged (``file``, ``key``, ``member``, ``reason``,
    ``error``: ``_damage``), in shard order; ``classes``: the class names of ImageFolder labels
    (``label`` n is ``classes[n]``), [] when the samples have none.
    """

    path: Path
    num_samples: int
    fingerprint: str
    shards: int
    errors: list[dict[str, str]] = field(default_factory=list)
    damaged: list[dict[str, str]] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every source was indexed whole: no error, no damaged sample."""
        return not self.errors and not self.damaged


class PartitionSpill:
    """Routes rows to partitions by key hash, appending each to its own Arrow stream file."""

    def __init__(self, directory: Path, partitions: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.partitions = partitions
        self._writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}

    def add(self, table: pa.Table) -> None:
        """Append ``table``'s rows (``ROW_SCHEMA``) to their partitions' spill files."""
        if table.num_rows == 0:
            return
        keys = table["key"].to_pylist()
        part = np.fromiter((xxhash.xxh64_intdigest(k.encode()) % self.partitions for k in keys), np.int64, len(keys))
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(self.partitions + 1))
        for p in np.flatnonzero(np.diff(bounds)):
            chunk = table.take(pa.array(order[bounds[p] : bounds[p + 1]]))
            self._writer(int(p)).write_table(chunk)

    def _writer(self, p: int) -> pa.ipc.RecordBatchStreamWriter:
        if p not in self._writers:
            self._writers[p] = pa.ipc.new_stream(str(self.directory / f"{p}.arrows"), ROW_SCHEMA)
        return self._writers[p]

    def partitions_in_order(self) -> Iterator[pa.Table]:
        """Each partition's rows (possibly none), closing the spill files first."""
        for writer in self._writers.values():
            writer.close()
        for p in range(self.partitions):
            path = self.directory / f"{p}.arrows"
            if p in self._writers:
                with pa.memory_map(str(path), "r") as source:
                    yield pa.ipc.open_stream(source).read_all()
            else:
                yield ROW_SCHEMA.empty_table()
        shutil.rmtree(self.directory, ignore_errors=True)


def write_index_files(
    out: Path,
    spill: PartitionSpill,
    shards: list[ShardSpec],
    shard_bytes: list[int],
    config: IndexConfig,
    errors: list[dict[str, str]],
    damaged: list[dict[str, str]] | None = None,
    *,
    classes: list[str] | None = None,
) -> IndexReport:
    """Write the index into ``out`` from the spilled rows; duplicated keys are appended to ``errors``.

    ``damaged``: the samples left out as damaged, summed up in the manifest (all of them in
    ``damaged.jsonl`` when there are more than the manifest lists); ``classes``: the class names
    of the samples' ImageFolder labels (the manifest's ``classes``). Raises ``SourceError`` when
    no sample at all is left to index.
    """
    damaged = damaged or []
    partitions, digests, shard_cols, length_cols = [], [], [], []
    for p, table in enumerate(spill.partitions_in_order()):
        table = _dedupe_sorted(table.sort_by([("key", "ascending"), ("shard", "ascending")]), shards, errors)
        pq.write_table(table, out / partition_file(p, "parquet"), row_group_size=_ROW_GROUP_ROWS, compression="zstd")
        write_arrow_partition(table, out / partition_file(p, "arrow"), ROW_SCHEMA)
        partitions.append({"file": partition_file(p, "parquet"), "rows": table.num_rows})
        digests.append(xxhash.xxh3_64_hexdigest(table["row_digest"].to_numpy().astype("<u8").tobytes()))
        shard_cols.append(table.select(["shard", "shard_row"]))
        length_cols.append(table.select(list(LENGTH_COLUMNS)))
    placement = pa.concat_tables(shard_cols)
    num_samples = placement.num_rows
    if num_samples == 0:
        raise SourceError("no sample could be indexed: " + "; ".join(e["error"] for e in errors))
    shard_ids = placement["shard"].to_numpy()
    np.save(out / BY_SHARD, np.lexsort((placement["shard_row"].to_numpy(), shard_ids)).astype(np.int64))
    counts = np.bincount(shard_ids, minlength=len(shards))
    pq.write_table(
        pa.table(
            {
                "shard": pa.array(range(len(shards)), pa.int32()),
                "url": [s.url for s in shards],
                "kind": [s.kind for s in shards],
                "size_bytes": pa.array(shard_bytes, pa.int64()),
                "num_samples": pa.array(counts, pa.int64()),
            }
        ),
        out / SHARDS,
    )
    content = {
        "format": INDEX_FORMAT,
        "config": config.model_dump(include={"tokenizer", "modalities", "key_column"}),
        "shards": [[s.url, s.kind, b] for s, b in zip(shards, shard_bytes)],
        "partitions": digests,
    }
    fingerprint = xxhash.xxh3_128_hexdigest(json.dumps(content, sort_keys=True).encode())
    lengths = pa.concat_tables(length_cols)
    manifest = {
        "format": INDEX_FORMAT,
        "num_samples": num_samples,
        "fingerprint": fingerprint,
        "partitions": partitions,
        "shards": len(shards),
        "key_hash": "xxh64(utf-8 key) % partitions",
        "modalities": _modality_counts(lengths, num_samples),
        "lengths": _length_stats(lengths),
        "config": config.model_dump(),
        "errors": errors,
        "damaged": damage_summary(damaged),
        "classes": list(classes or []),
    }
    write_length_files(out, lengths, LENGTH_COLUMNS)
    if "file" in manifest["damaged"]:
        with open(out / DAMAGED_FILE, "w", encoding="utf-8") as listing:
            listing.writelines(json.dumps(entry) + "\n" for entry in damaged)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return IndexReport(
        path=out,
        num_samples=num_samples,
        fingerprint=fingerprint,
        shards=len(shards),
        errors=errors,
        damaged=damaged,
        classes=list(classes or []),
    )


def _dedupe_sorted(table: pa.Table, shards: list[ShardSpec], errors: list[dict[str, str]]) -> pa.Table:
    """Keep the first of rows sharing a key (table sorted by key, shard); report each duplicate."""
    if table.num_rows < 2:
        return table
    keys = table["key"]
    same = pc.equal(keys.slice(1), keys.slice(0, table.num_rows - 1)).to_numpy(zero_copy_only=False)
    dup_rows = np.flatnonzero(same) + 1
    if dup_rows.size == 0:
        return table
    shard_ids = table["shard"].to_numpy()
    for r in dup_rows.tolist():
        key, first, again = keys[r].as_py(), shards[shard_ids[r - 1]].url, shards[shard_ids[r]].url
        errors.append(
            {
                "source": again,
                "key": key,
                "error": f"duplicate key {key!r} in {again} (also in {first}); kept the first. "
                "Keys must be unique across sources: rename one, or index the sources separately",
            }
        )
    keep = np.ones(table.num_rows, dtype=bool)
    keep[dup_rows] = False
    return table.filter(pa.array(keep))


def _modality_counts(lengths: pa.Table, num_samples: int) -> dict[str, int]:
    has = {
        "text": lengths["text_tokens"],
        "image": lengths["image_width"],
        "video": lengths["video_frames"],
        "audio": lengths["audio_seconds"],
    }
    counts = {m: int(pc.sum(pc.greater(col, 0)).as_py() or 0) for m, col in has.items()}
    return {"samples": num_samples, **counts}


def _length_stats(lengths: pa.Table) -> dict[str, dict[str, float]]:
    stats: dict[str, dict[str, float]] = {}
    for name in LENGTH_COLUMNS:
        values = lengths[name].to_numpy()
        values = values[values > 0]
        if values.size == 0:
            continue
        q = np.quantile(values, list(_STAT_QUANTILES.values()))
        stats[name] = {
            "count": int(values.size),
            "min": float(values.min()),
            "max": float(values.max()),
            "mean": float(values.mean()),
            "sum": float(values.sum(dtype=np.float64)),
            **{k: float(v) for k, v in zip(_STAT_QUANTILES, q)},
        }
    return stats
