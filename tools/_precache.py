"""`omnifeed precache`, one partition's work: fill the NVMe tier with the entries the feed will look up.

A task takes one index partition and, for each sample in the order its shard holds it (a
Parquet file's row groups and pages in turn, so each page is decoded once), the fields the feed
reads (``fields_to_decode``): it skips the entries the tier already holds, reads the rest from the
origin through the remote tier (timeouts, retries) in I/O threads, decodes them when entries
are decoded (meta fields stay raw, as the feed keeps them), and writes them in batches, one
LMDB transaction each. A killed run keeps every committed batch; the next run skips them.

Keys are the feed's own (``FieldSource.raw_key`` / ``decoded_key`` under the index fingerprint
and the decode settings), so a feed with the same settings finds every entry. Drivers that run
the tasks (local processes, Ray) are in ``_precache_run`` and ``_ray``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from omnifeed.cache import CacheConfig, NvmeTier, NvmeTierConfig, RemoteTierConfig
from omnifeed.loader import DecodeConfig, FieldLocation, IndexedSample, SampleIndex, make_decoder
from omnifeed.loader.decode import follow_index_tokenizer
from omnifeed.loader.feed import FieldSource, encode_decoded, fields_to_decode

_CHUNK_SAMPLES = 256  # index rows looked up at once
_FAILURES_KEPT = 50  # per task: named in the report; the rest are counted
_REPORT_S = 0.25  # progress yielded at most this often (and when the task ends)


@dataclass(frozen=True)
class PrecacheJob:
    """What to precache: the index, the tier, raw or decoded entries, how to decode and read the origin.

    ``batch_entries`` / ``batch_bytes``: a write transaction holds at most this many entries /
    entry bytes (whichever comes first). The index and tier paths are made absolute here, so that
    tasks running elsewhere (a Ray worker has another working directory) find them.
    """

    index: str
    nvme: NvmeTierConfig
    entries: Literal["raw", "decoded"] = "raw"
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)
    batch_entries: int = 64
    batch_bytes: int = 32 * 2**20

    def __post_init__(self) -> None:
        if self.batch_entries < 1 or self.batch_bytes < 1:
            raise ValueError(
                f"batch_entries and batch_bytes must be positive, got {self.batch_entries}, {self.batch_bytes}"
            )
        object.__setattr__(self, "index", os.path.abspath(self.index))
        object.__setattr__(self, "nvme", self.nvme.model_copy(update={"path": os.path.abspath(self.nvme.path)}))


@dataclass
class Counts:
    """Entries and bytes of a task or a run: ``cached`` (written now), ``present`` (already held, not read),
    ``failed`` (read or decode failed), ``not_held`` (read, but the tier turned it away: too large or full);
    ``fetched_bytes`` read from the origin, ``stored_bytes`` written, ``handled_bytes`` (source bytes of every
    entry dealt with: the progress measure)."""

    cached: int = 0
    present: int = 0
    failed: int = 0
    not_held: int = 0
    fetched_bytes: int = 0
    stored_bytes: int = 0
    handled_bytes: int = 0

    def add(self, other: Counts) -> None:
        """Add ``other`` into this."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class Failure:
    """One entry that could not be cached: the sample key, field, source URL and the error."""

    key: str
    field: str
    url: str
    error: str

    def __str__(self) -> str:
        return f"sample {self.key!r} field {self.field!r} from {self.url}: {self.error}"


@dataclass
class PartitionResult:
    """What one task did: its counts, the failures it names, and why the tier stopped caching, if it did."""

    partition: int
    counts: Counts
    failures: list[Failure]
    degraded: str | None
    seconds: float
    node: str = ""


def partition_span(index: SampleIndex, partition: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of a partition's samples."""
    rows = [int(p["rows"]) for p in index.manifest["partitions"]]
    if not 0 <= partition < len(rows):
        raise ValueError(f"partition {partition} outside the index's {len(rows)} partitions (0-{len(rows) - 1})")
    start = sum(rows[:partition])
    return start, start + rows[partition]


def partition_bytes(index: SampleIndex, partition: int) -> int:
    """Source bytes of the fields the feed reads in one partition, from its Parquet file (batch by batch)."""
    path = index.path / index.manifest["partitions"][partition]["file"]
    total = 0
    for batch in pq.ParquetFile(path).iter_batches(columns=["fields"], batch_size=65536):
        column = batch.column(0)
        flat = column.flatten()
        if len(flat) == 0:
            continue
        parents = pc.list_parent_indices(column).to_numpy()
        modality = pc.dictionary_encode(flat.field("modality"))
        codes = modality.indices.to_numpy()
        sizes = flat.field("size").to_numpy()
        names = modality.dictionary.to_pylist()
        meta = codes == names.index("meta") if "meta" in names else np.zeros(len(codes), dtype=bool)
        total += int(sizes[meta].sum())
        # the first field of each (sample, modality), as fields_to_decode picks it
        _, first = np.unique(parents[~meta].astype(np.int64) * len(names) + codes[~meta], return_index=True)
        total += int(sizes[~meta][first].sum())
    return total


def run_partition(job: PrecacheJob, partition: int) -> Generator[Counts | PartitionResult, None, None]:
    """Precache one partition: yields progress (Counts since the last yield, every quarter second or so), then
    its PartitionResult. Closing the generator early stops the task (what it committed stays)."""
    task = _PartitionTask(job, partition)
    try:
        yield from task.run()
    finally:
        task.close()


_INDEXES: dict[str, SampleIndex] = {}
_INDEXES_LOCK = threading.Lock()


def _open_index(path: str) -> SampleIndex:
    """The index, opened once per process: mapping it again for every partition cost a sixth of a run."""
    with _INDEXES_LOCK:
        if path not in _INDEXES:
            _INDEXES[path] = SampleIndex(path)
        return _INDEXES[path]


class _PartitionTask:
    """One partition: look up, skip what is held, fetch and decode in threads, write in batches."""

    def __init__(self, job: PrecacheJob, partition: int) -> None:
        self.job, self.partition = job, partition
        self.index = _open_index(job.index)
        self.start, self.stop = partition_span(self.index, partition)
        self.decode = follow_index_tokenizer(job.decode, self.index.manifest)  # the feed's decoders, keys alike
        # a chain without tiers: keys and origin reads only; this task writes the tier itself, in batches
        self.source = FieldSource(
            CacheConfig(remote=job.remote, entries=job.entries), self.index.fingerprint, self.decode
        )
        self.tier = NvmeTier(job.nvme)
        self.threads = ThreadPoolExecutor(job.remote.io_threads, thread_name_prefix="omnifeed-precache")
        self._decoders: dict[str, Any] = {}
        self._decoders_lock = threading.Lock()
        self._batch: list[tuple[bytes, bytes]] = []
        self._batch_bytes = self._batch_sources = 0
        self.delta, self.total = Counts(), Counts()
        self._reported = time.monotonic()
        self.failures: list[Failure] = []

    def run(self) -> Iterator[Counts | PartitionResult]:
        started = time.perf_counter()
        in_flight: deque[tuple[Future[bytes], IndexedSample, FieldLocation, bytes]] = deque()
        window = 2 * self.job.remote.io_threads
        order = self._in_shard_order()
        for chunk in range(0, len(order), _CHUNK_SAMPLES):
            for sample in self.index.samples(order[chunk : chunk + _CHUNK_SAMPLES]):
                if self.tier.degraded is not None:
                    break
                for _, location in fields_to_decode(sample):
                    key, modality = self._entry(sample, location)
                    if self.tier.contains(key):
                        self._count(present=1, handled_bytes=location.size)
                        continue
                    in_flight.append(
                        (self.threads.submit(self._fetch, sample, location, modality), sample, location, key)
                    )
                    while len(in_flight) >= window:
                        self._collect(*in_flight.popleft())
                if self._report_due():
                    yield self._take_delta()
        while in_flight and self.tier.degraded is None:
            self._collect(*in_flight.popleft())
            if self._report_due():
                yield self._take_delta()
        self._flush()
        for future, *_ in in_flight:  # the tier stopped caching: reads not started are dropped
            future.cancel()
        if self.delta:
            yield self._take_delta()
        yield PartitionResult(
            self.partition, self.total, self.failures, self.tier.degraded, time.perf_counter() - started
        )

    def _in_shard_order(self) -> np.ndarray:
        """The partition's positions as their shards hold them (a Parquet file's rows page after page, a tar's
        members in turn): neighbouring reads share a decoded page (``loader/index/_parquet_cells``) or a read-ahead."""
        by_shard = self.index.by_shard
        return np.asarray(by_shard[(by_shard >= self.start) & (by_shard < self.stop)], dtype=np.int64)

    def _entry(self, sample: IndexedSample, location: FieldLocation) -> tuple[bytes, str | None]:
        """The entry's key, and the modality to decode with (None: the raw bytes are the entry)."""
        key = self.source.decoded_key(sample, location)
        if key is not None:
            return key, location.modality
        return self.source.raw_key(sample, location), None

    def _fetch(self, sample: IndexedSample, location: FieldLocation, modality: str | None) -> bytes:
        data = self.source.origin(sample, location)
        if modality is None:
            return data
        return encode_decoded(self._decoder(modality)(data, sample.key))

    def _decoder(self, modality: str) -> Any:
        with self._decoders_lock:
            if modality not in self._decoders:
                self._decoders[modality] = make_decoder(modality, self.decode)
            return self._decoders[modality]

    def _collect(self, future: Future[bytes], sample: IndexedSample, location: FieldLocation, key: bytes) -> None:
        try:
            entry = future.result()
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001  a source or decoder may fail any way it likes: counted and named
            error = "; ".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])])
            if len(self.failures) < _FAILURES_KEPT:
                self.failures.append(Failure(sample.key, location.name, sample.shard.url, error))
            self._count(failed=1, handled_bytes=location.size)
            return
        self._batch.append((key, entry))
        self._batch_bytes += len(entry)
        self._batch_sources += location.size
        self._count(fetched_bytes=location.size)
        if len(self._batch) >= self.job.batch_entries or self._batch_bytes >= self.job.batch_bytes:
            self._flush()

    def _flush(self) -> None:
        """Write the batch in one transaction and count what the tier holds afterwards."""
        if not self._batch:
            return
        before = self.tier.stats()
        held = self.tier.put_many(self._batch, accessed=False)
        after = self.tier.stats()
        cached = after["puts"] - before["puts"]
        self._count(
            cached=cached,
            present=held - cached,
            not_held=len(self._batch) - held,
            stored_bytes=after["bytes_put"] - before["bytes_put"],
            handled_bytes=self._batch_sources,
        )
        self._batch, self._batch_bytes, self._batch_sources = [], 0, 0

    def _count(self, **amounts: int) -> None:
        change = Counts(**amounts)
        self.delta.add(change)
        self.total.add(change)

    def _report_due(self) -> bool:
        return bool(self.delta) and time.monotonic() - self._reported >= _REPORT_S

    def _take_delta(self) -> Counts:
        delta, self.delta, self._reported = self.delta, Counts(), time.monotonic()
        return delta

    def close(self) -> None:
        """Stop the I/O threads (a stuck read is abandoned) and close the tier and the origin reader."""
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.tier.close()
        self.source.close()
