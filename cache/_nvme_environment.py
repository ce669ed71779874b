"""The NVMe tier's LMDB environments (one per process and path) and frequency sketch, and the gate that lets a map
resize run alone.

LMDB must not open the same file twice in a process: environments are shared by the tiers of one
process and counted, and a copy inherited over ``fork`` is released before the child opens its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np

from ._sketch import FrequencySketch

AVERAGE_ENTRY = 64 * 1024  # sizing assumption for the sketch
SKETCH_HEADER = 64
SUB_DATABASES = (b"data", b"queue", b"meta", b"info")

_ENVIRONMENTS: dict[tuple[int, str], tuple[lmdb.Environment, int]] = {}
_ENVIRONMENTS_LOCK = threading.Lock()


class Gate:
    """Many transactions at once, or one map resize alone (LMDB forbids resizing under live transactions)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


def shared_environment(root: Path, initial_map: int) -> lmdb.Environment:
    """This process's environment of ``root``, opened (map ``initial_map`` bytes) unless a tier of it already has it."""
    key = (os.getpid(), str(root))
    with _ENVIRONMENTS_LOCK:
        for inherited in [k for k in _ENVIRONMENTS if k[0] != key[0]]:
            # opened by the parent before a fork: release the child's copy (py-lmdb only
            # unmaps it) so this process can open the environment for itself
            _ENVIRONMENTS.pop(inherited)[0].close()
        env, users = _ENVIRONMENTS.get(key, (None, 0))
        if env is None:
            env = lmdb.open(
                str(root),
                map_size=initial_map,
                max_dbs=len(SUB_DATABASES),
                max_readers=1024,
                readahead=False,
                meminit=False,
                sync=False,
                metasync=False,
                mode=0o600,
            )
        _ENVIRONMENTS[key] = (env, users + 1)
        return env


def release_environment(pid: int, root: Path, env: lmdb.Environment) -> None:
    """One tier of process ``pid`` is done with ``env``: closed when it was the last."""
    key = (pid, str(root))
    with _ENVIRONMENTS_LOCK:
        _, users = _ENVIRONMENTS.get(key, (env, 1))
        if users <= 1:
            _ENVIRONMENTS.pop(key, None)
            env.close()
        else:
            _ENVIRONMENTS[key] = (env, users - 1)


def open_sketch(root: Path, capacity: int) -> tuple[np.ndarray, FrequencySketch]:
    """The frequency sketch in ``root/sketch.bin`` (created for ``capacity`` bytes of entries): its 8-byte counters
    header and the sketch, both views of one shared file mapping."""
    path = root / "sketch.bin"
    width = FrequencySketch.width_for(capacity // AVERAGE_ENTRY)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, SKETCH_HEADER + FrequencySketch.nbytes(width))
        finally:
            os.close(fd)
    except FileExistsError:
        # Another process may have it mapped: never resize it (that would SIGBUS them).
        # Adopt its width; the sketch only steers admission, any width works.
        for _ in range(100):  # the creator sizes it right after creating it
            found = (path.stat().st_size - SKETCH_HEADER) // FrequencySketch.nbytes(1)
            if found > 0:
                break
            time.sleep(0.01)
        if found >= 1024 and found & (found - 1) == 0:
            width = found
        else:
            raise OSError(
                f"{path} is not a frequency sketch of this version; remove it (the cache stays valid)"
            ) from None
    size = SKETCH_HEADER + FrequencySketch.nbytes(width)
    mapping = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
    return mapping[:8].view("<u8"), FrequencySketch(
        mapping[SKETCH_HEADER:], width, sample_size=10 * max(1024, width // 4)
    )
