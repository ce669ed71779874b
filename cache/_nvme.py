"""The NVMe tier: an LMDB environment on local disk, byte-bounded, checksummed, shared by processes.

Its records (sub-databases ``data``, ``queue``, ``meta``, ``info``) and the frequency-guarded FIFO
that evicts among them are ``_nvme_queue``'s `EntryQueue`, which `NvmeTier` is; the frequency sketch
is kept in ``sketch.bin`` beside the environment (a shared file mapping, so every process counts
into it). This module is the tier's public operations, its lifecycle, and its transactions.

LMDB gives the rest: one writer at a time across processes, readers that never block,
atomic transactions (a process killed mid-write leaves the last committed state). The
environment is opened per process, lazily, so a tier object survives ``fork`` and pickling.
A write that fails for lack of space (a full disk, a map that cannot grow) turns the tier
into pass-through with one warning; entries already held are still served.

The tier is the user's own or it is refused (`CacheError`; the chain then runs without it,
as for the RAM tier): the directory (links resolved) and the files in it must belong to the
user and not be writable by group or others; it is created 0700, the files 0600. Checksums
are keyed with a per-cache secret (32 random bytes in ``secret``, 0600): the xxh3-64 of an
entry is seeded by a keyed BLAKE2b of its key, so a writer without the secret cannot make an
entry that passes. A cache without a secret (an older version's) gets one, and its entries
are dropped (they are read again from the source).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from ._config import NvmeTierConfig
from ._errors import CacheError
from ._nvme_directory import DRAFT_PREFIX, FILES, cache_secret, checksum, owned_directory
from ._nvme_environment import SUB_DATABASES, Gate, open_sketch, release_environment, shared_environment
from ._nvme_queue import EntryQueue

log = logging.getLogger(__name__)

_MAX_ENTRY_FRACTION = 0.125
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class NvmeTier(EntryQueue):
    """Byte-bounded LMDB cache of immutable entries keyed by 16-byte digests.

    Raises CacheError when ``config.path`` or a file in it belongs to another user or is writable
    by others (the message says what to do); other failures to open make it pass-through.
    """

    SUB_DATABASES = SUB_DATABASES
    """The LMDB sub-databases of a tier: an environment holding them all is an omnifeed tier."""

    @staticmethod
    def is_own_file(name: str) -> bool:
        """Whether a file called ``name`` in a tier's directory is one the tier keeps there (or a secret being
        written)."""
        return name in FILES or name.startswith(DRAFT_PREFIX)

    def __init__(self, config: NvmeTierConfig) -> None:
        self._setup(config)
        self._open(strict=True)

    def _setup(self, config: NvmeTierConfig) -> None:
        self.config = config
        self.path = Path(config.path)
        self.capacity = config.capacity_bytes
        self.max_map = config.max_map_bytes or 4 * config.capacity_bytes
        self._max_entry = int(self.capacity * _MAX_ENTRY_FRACTION)
        self._pid = -1
        self._env: lmdb.Environment | None = None
        self._gate = Gate()
        self._write_lock = threading.Lock()
        self.degraded: str | None = None
        self._stats = {
            "hits": 0,
            "misses": 0,
            "bytes_hit": 0,
            "puts": 0,
            "bytes_put": 0,
            "rejected": 0,
            "evicted": 0,
            "reinserted": 0,
            "too_large": 0,
            "corrupt": 0,
            "map_grown": 0,
        }
        self._stats_lock = threading.Lock()
        self._root = self.path
        self._secret = b""

    # -- lifecycle ---------------------------------------------------------------------------

    def _open(self, strict: bool = False) -> None:
        """Open this process's handle; ``strict``: raise CacheError for a tier another user could reach."""
        self._pid = os.getpid()
        self._env = None  # a parent's handle (after fork) is released by _environment
        try:
            self._root = owned_directory(self.path)  # cached samples are the user's data
            self._secret, made = cache_secret(self._root)
            self._env = self._environment()
            self._data, self._queue, self._meta, self._info = (self._env.open_db(name) for name in SUB_DATABASES)
            self._open_sketch()
            if made:
                self._forget_unkeyed()
        except CacheError as exc:
            self.close()
            if strict:
                raise
            self.degraded = f"refused: {exc}"
            log.warning("NVMe tier %s is refused; running without it: %s", self.path, exc)
        except (OSError, lmdb.Error) as exc:
            self.close()
            self._degrade(f"cannot open it: {exc}", "make nvme.path a writable local directory")

    def _forget_unkeyed(self) -> None:
        """Drop the entries of a cache that had no secret: their checksums cannot be trusted."""
        with self._write_lock, self._txn(write=True) as txn:
            count = self._remove_all(txn)
        if count:
            log.warning(
                "NVMe tier %s had no secret for its checksums: made one, and dropped its %d entries (they are "
                "read again from the source)",
                self.path,
                count,
            )

    def _environment(self) -> lmdb.Environment:
        return shared_environment(self._root, min(self.max_map, max(2 * self.capacity, 64 * 2**20)))

    def _open_sketch(self) -> None:
        self._sketch_ops, self._sketch = open_sketch(self._root, self.capacity)

    def _ready(self) -> bool:
        if self._pid != os.getpid():  # forked or unpickled: this process opens its own environment
            self._open()
        return self._env is not None

    def close(self) -> None:
        """Close this process's handle (idempotent)."""
        env, self._env = self._env, None
        if env is None or self._pid != os.getpid():
            return
        release_environment(self._pid, self._root, env)

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["config"])
        self._open()  # another process: a tier refused there runs as pass-through, with a warning

    def _degrade(
        self, why: str, fix: str = "free space on that disk or raise nvme.max_map_bytes, then restart"
    ) -> None:
        if self.degraded is None:
            self.degraded = why
            log.warning(
                "NVMe tier %s stops caching and passes reads through: %s. To cache again: %s; entries "
                "already cached are still served.",
                self.path,
                why,
                fix,
            )

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[name] += n

    # -- transactions ----------------------------------------------------------------------------

    @contextmanager
    def _txn(self, write: bool) -> Iterator[lmdb.Transaction]:
        assert self._env is not None
        for _ in range(3):
            try:
                with self._gate.shared():
                    with self._env.begin(write=write, buffers=True) as txn:
                        yield txn
                return
            except lmdb.MapResizedError:  # another process grew the map: adopt its size
                with self._gate.exclusive():
                    self._env.set_mapsize(0)
        raise lmdb.MapResizedError("the map kept changing size")

    def _grow(self) -> bool:
        assert self._env is not None
        current = self._env.info()["map_size"]
        if current >= self.max_map:
            return False
        with self._gate.exclusive():
            self._env.set_mapsize(min(self.max_map, current * 2))
        self._count("map_grown")
        return True

    # -- public operations -------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The entry's bytes, or None (absent, or corrupt: then it is dropped and counted)."""
        if not self._ready():
            return None
        self._touch(key)
        try:
            with self._txn(write=False) as txn:
                raw = txn.get(key, db=self._data)
                if raw is None:
                    self._count("misses")
                    return None
                value = bytes(raw[8:])
                intact = checksum(self._secret, key, value) == bytes(raw[:8])
        except lmdb.Error as exc:
            self._degrade(f"a read failed: {exc}")
            return None
        if not intact:
            log.warning(
                "NVMe tier %s: entry %s failed its checksum; dropped and read again from the source",
                self.path,
                key.hex(),
            )
            self._count("corrupt")
            self._drop(key)
            return None
        with self._stats_lock:
            self._stats["hits"] += 1
            self._stats["bytes_hit"] += len(value)
        return value

    def contains(self, key: bytes) -> bool:
        """Whether an entry is held (not verified, not counted as an access)."""
        if not self._ready():
            return False
        try:
            with self._txn(write=False) as txn:
                return txn.get(key, db=self._meta) is not None
        except lmdb.Error:
            return False

    def put(self, key: bytes, value: bytes, *, accessed: bool = True) -> bool:
        """Store an entry unless admission turns it away or the tier is degraded; True when it is held.

        ``accessed``: the caller's `get` of this key just missed, so its access is already counted.
        """
        return self.put_many([(key, value)], accessed=accessed) == 1

    def put_many(self, entries: list[tuple[bytes, bytes]], *, accessed: bool = False) -> int:
        """Store several entries in one transaction (pre-caching); how many are held afterwards."""
        if not self._ready() or self.degraded is not None:
            return 0
        with self._write_lock:  # one writer per process; LMDB serialises the processes
            for _ in range(8):
                try:
                    return self._put_many(entries, accessed)
                except lmdb.MapFullError:
                    if not self._grow():
                        self._degrade(f"the LMDB map is full at {self.max_map} bytes (nvme.max_map_bytes)")
                        return 0
                except lmdb.Error as exc:
                    self._degrade(f"a write failed: {exc}")
                    return 0
                except OSError as exc:
                    if exc.errno not in _NO_SPACE:
                        raise
                    self._degrade(f"a write failed: {exc}")
                    return 0
            self._degrade("the LMDB map kept filling up")
            return 0

    def _put_many(self, entries: list[tuple[bytes, bytes]], accessed: bool) -> int:
        counts = {"puts": 0, "bytes_put": 0, "rejected": 0, "evicted": 0, "reinserted": 0, "too_large": 0}
        with self._txn(write=True) as txn:
            held = self._store(txn, entries, accessed, counts)
        with self._stats_lock:
            for name, n in counts.items():
                self._stats[name] += n
        return held

    def discard(self, key: bytes) -> None:
        """Forget an entry a reader found unusable (a later ``put`` stores anew)."""
        self._drop(key)

    def _drop(self, key: bytes) -> None:
        if self.degraded is not None:
            return
        try:
            with self._write_lock, self._txn(write=True) as txn:
                self._remove(txn, key)
        except lmdb.Error as exc:
            self._degrade(f"a write failed: {exc}")

    def stats(self) -> dict[str, Any]:
        """This process's hits/misses/bytes, and the tier's occupancy (all processes)."""
        with self._stats_lock:
            out: dict[str, Any] = dict(self._stats)
        entries = used = 0
        if self._ready():
            try:
                with self._txn(write=False) as txn:
                    _, used, entries = self._totals(txn)
            except lmdb.Error:
                pass
        out.update(entries=entries, bytes_used=used, capacity_bytes=self.capacity, degraded=self.degraded)
        return out

    def keys(self) -> Iterator[bytes]:
        """Every key held (for checks and tools)."""
        if not self._ready():
            return
        with self._txn(write=False) as txn, txn.cursor(db=self._meta) as cursor:
            for key in cursor.iternext(keys=True, values=False):
                yield bytes(key)
