"""A keyed pseudo-random permutation of ``range(n)``: any position in O(1), no memory per sample.

A balanced Feistel network over the smallest even number of bits that covers
``n``, with cycle walking to stay inside ``range(n)`` (values of the wider
domain that fall outside are fed through the network again; each value needs
fewer than four passes on average). Round keys come from
``numpy.random.SeedSequence`` so that the permutation is a pure function of
``(n, key)``; it is vectorised over numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_ROUNDS = 6
_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-spread 64-bit hash (wraps modulo 2**64)."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


class KeyedPermutation:
    """Bijection of ``range(n)`` determined by ``key`` (a sequence of non-negative ints)."""

    def __init__(self, n: int, key: Sequence[int]) -> None:
        if n < 0:
            raise ValueError(f"permutation size must be >= 0, got {n}")
        self.n = n
        bits = max(2, (max(n - 1, 1)).bit_length())
        bits += bits % 2
        self._half = _U64(bits // 2)
        self._mask = _U64((1 << (bits // 2)) - 1)
        seeds = np.random.SeedSequence([int(k) for k in key]).generate_state(_ROUNDS, dtype=np.uint64)
        self._round_keys = [_U64(k) for k in seeds]
        self.evaluations = 0  # positions mapped so far; lets tests count work, not time

    def __call__(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """Images of ``positions`` (each in ``range(n)``) as an int64 array."""
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions must lie in range({self.n})")
        self.evaluations += int(x.size)
        y = self._network(x.astype(np.uint64))
        outside = y >= _U64(self.n)
        while outside.any():
            y[outside] = self._network(y[outside])
            outside = y >= _U64(self.n)
        return y.astype(np.int64)

    def _network(self, x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            left, right = x >> self._half, x & self._mask
            for round_key in self._round_keys:
                left, right = right, left ^ (_mix64(right ^ round_key) & self._mask)
            return (left << self._half) | right
