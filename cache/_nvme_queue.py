"""The NVMe tier's records, and the frequency-guarded FIFO that makes room among them, within one LMDB transaction.

Sub-databases: ``data`` (key → xxh3-64 checksum + bytes), ``queue`` (sequence number → key:
insertion order, oldest first), ``meta`` (key → sequence number + size) and ``info`` (totals:
next sequence number, bytes used, entries). Eviction is the same frequency-guarded FIFO as the
RAM tier's over a frequency sketch kept in ``sketch.bin`` beside the environment (``_nvme_environment``).

`EntryQueue` is the part of `NvmeTier` that reads and writes these records; the tier (``_nvme``)
opens the transaction, holds its write lock around a write, and turns LMDB's failures into
pass-through.
"""

from __future__ import annotations

import struct

import lmdb
import numpy as np

from ._nvme_directory import checksum
from ._sketch import SCAN_LIMIT, FrequencySketch, keeps_victim

_META = struct.Struct("<QQ")  # sequence number, accounted size


class EntryQueue:
    """The records of an open tier and the eviction over them; `NvmeTier` is one (it passes each call a transaction)."""

    capacity: int
    _max_entry: int
    _secret: bytes
    _sketch: FrequencySketch
    _sketch_ops: np.ndarray
    _data: lmdb._Database
    _queue: lmdb._Database
    _meta: lmdb._Database
    _info: lmdb._Database

    def _store(
        self, txn: lmdb.Transaction, entries: list[tuple[bytes, bytes]], accessed: bool, counts: dict[str, int]
    ) -> int:
        """Store the entries admission lets in, making room as it goes; how many are held afterwards."""
        held = 0
        seq, used, count = self._totals(txn)
        if int(self._sketch_ops[0]) >= self._sketch.sample_size:
            self._sketch_ops[0] = 0
            self._sketch.halve()
        for key, value in entries:
            if txn.get(key, db=self._meta) is not None:
                held += 1
                continue
            size = len(key) + 8 + len(value) + _META.size
            if size > self._max_entry:
                counts["too_large"] += 1
                continue
            newcomer = self._sketch.estimate(key) - (1 if accessed else 0)
            room = True
            while used + size > self.capacity:
                freed = self._evict_one(txn, newcomer, counts)
                if freed is None:
                    room = False
                    break
                seq = max(seq, freed[1])
                used -= freed[0]
                count -= 1
            if not room:
                counts["rejected"] += 1
                continue
            txn.put(key, checksum(self._secret, key, value) + value, db=self._data)
            txn.put(key, _META.pack(seq, size), db=self._meta)
            txn.put(seq.to_bytes(8, "big"), key, db=self._queue)
            seq, used, count, held = seq + 1, used + size, count + 1, held + 1
            counts["puts"] += 1
            counts["bytes_put"] += len(value)
        txn.put(b"totals", struct.pack("<QQQ", seq, used, count), db=self._info)
        return held

    def _totals(self, txn: lmdb.Transaction) -> tuple[int, int, int]:
        raw = txn.get(b"totals", db=self._info)
        return struct.unpack("<QQQ", raw) if raw is not None else (0, 0, 0)

    def _evict_one(self, txn: lmdb.Transaction, newcomer: int, counts: dict[str, int]) -> tuple[int, int] | None:
        """Evict the first of the oldest entries the newcomer outranks, requeueing those before it.

        Returns (bytes freed, next free sequence number), or None when none of the first
        SCAN_LIMIT entries yields (the newcomer is turned away; nothing changes).
        """
        victims: list[tuple[bytes, bytes]] = []
        with txn.cursor(db=self._queue) as cursor:
            for seq_bytes, key in cursor:
                victims.append((bytes(seq_bytes), bytes(key)))
                if len(victims) == SCAN_LIMIT:
                    break
        chosen = next(
            (i for i, (_, key) in enumerate(victims) if not keeps_victim(self._sketch.estimate(key), newcomer)), None
        )
        if chosen is None:
            return None
        last = txn.cursor(db=self._queue)
        next_seq = int.from_bytes(last.key(), "big") + 1 if last.last() else 0
        for seq_bytes, key in victims[:chosen]:
            size = _META.unpack(bytes(txn.get(key, db=self._meta) or b""))[1]
            txn.delete(seq_bytes, db=self._queue)
            txn.put(next_seq.to_bytes(8, "big"), key, db=self._queue)
            txn.put(key, _META.pack(next_seq, size), db=self._meta)
            next_seq += 1
            counts["reinserted"] += 1
        seq_bytes, key = victims[chosen]
        size = _META.unpack(bytes(txn.get(key, db=self._meta) or b""))[1]
        txn.delete(seq_bytes, db=self._queue)
        txn.delete(key, db=self._meta)
        txn.delete(key, db=self._data)
        counts["evicted"] += 1
        return size, next_seq

    def _remove(self, txn: lmdb.Transaction, key: bytes) -> None:
        """Remove an entry's records, if it is held."""
        meta = txn.get(key, db=self._meta)
        if meta is None:
            return
        seq, size = _META.unpack(meta)
        txn.delete(seq.to_bytes(8, "big"), db=self._queue)
        txn.delete(key, db=self._meta)
        txn.delete(key, db=self._data)
        next_seq, used, count = self._totals(txn)
        txn.put(b"totals", struct.pack("<QQQ", next_seq, used - size, count - 1), db=self._info)

    def _remove_all(self, txn: lmdb.Transaction) -> int:
        """Remove every entry; how many there were."""
        _, _, count = self._totals(txn)
        for db in (self._data, self._queue, self._meta):
            txn.drop(db, delete=False)
        txn.put(b"totals", struct.pack("<QQQ", 0, 0, 0), db=self._info)
        return count

    def _touch(self, key: bytes) -> None:
        self._sketch.increment(key)
        self._sketch_ops[0] += 1
