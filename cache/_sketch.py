"""A count-min frequency sketch with periodic halving over a shared buffer, for admission decisions."""

from __future__ import annotations

import numpy as np

_ROWS = 4
_MASK64 = (1 << 64) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)


class FrequencySketch:
    """Approximate access counts of keys (16-byte digests) in ``4 x width`` saturating 8-bit counters.

    The counters live in a caller-provided buffer (a shared-memory segment or a shared file
    map) so every process of the node counts into one sketch. Concurrent increments may
    lose a count now and then; the sketch only steers eviction, so that is harmless. After
    ``sample_size`` increments every counter is halved, so old popularity fades.
    """

    def __init__(self, counters: np.ndarray, width: int, sample_size: int) -> None:
        if width & (width - 1) or counters.dtype != np.uint8 or counters.size != _ROWS * width:
            raise ValueError(f"a sketch of width {width} needs {_ROWS * width} uint8 counters (width a power of two)")
        self._table = counters.reshape(_ROWS, width)
        self._bits = width.bit_length() - 1
        self.sample_size = sample_size

    @staticmethod
    def nbytes(width: int) -> int:
        """Bytes of buffer a sketch of ``width`` needs."""
        return _ROWS * width

    @staticmethod
    def width_for(entries: int) -> int:
        """A width that keeps collisions rare for about ``entries`` keys in the sampling window."""
        return 1 << max(10, min(26, (max(entries, 1) * 4 - 1).bit_length()))

    def _columns(self, key: bytes) -> list[int]:
        k0 = int.from_bytes(key[:8], "little")
        k1 = int.from_bytes(key[8:16], "little") | 1
        shift = 64 - self._bits
        return [(((k0 ^ (k1 * seed)) * 0xFF51AFD7ED558CCD) & _MASK64) >> shift for seed in _SEEDS]

    def estimate(self, key: bytes) -> int:
        """The key's approximate count since the last halvings."""
        table = self._table
        return min(int(table[row, column]) for row, column in enumerate(self._columns(key)))

    def increment(self, key: bytes) -> None:
        """Count one access (the owner counts increments and calls `halve` every ``sample_size``)."""
        table = self._table
        for row, column in enumerate(self._columns(key)):
            if table[row, column] < 255:
                table[row, column] += 1

    def halve(self) -> None:
        """Halve every counter (ageing)."""
        self._table >>= 1


SCAN_LIMIT = 8  # victims examined for one newcomer before it is turned away


def keeps_victim(victim_count: int, newcomer_count: int) -> bool:
    """The admission rule: a queued entry used at least as often as the newcomer stays (goes to the back).

    ``newcomer_count`` excludes the access that is inserting it, so under epoch-style access
    (every sample once per epoch, random order) the resident set stays put instead of
    churning: with a cache holding a quarter of the data this hits 7x as often as LRU
    (benchmarks/bench_cache_policy.py).
    """
    return victim_count >= newcomer_count
