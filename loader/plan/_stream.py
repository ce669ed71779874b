"""An epoch's sample stream: the shuffled order of all positions, any slice computable on its own.

- ``permutation``: ``stream[i] = π(i)``, π a keyed permutation of ``range(N)`` keyed by
  (seed, epoch): O(1) work and no memory per position.
- ``shard_block``: shards in a keyed shuffled order, grouped into windows of
  ``shards_per_window`` shards; each window's samples shuffled within it. Reading stays
  sequential within a few shards. Locating a slice costs O(shards) once per epoch.
- ``none``: index order.

``work`` counts the positions computed (permutation evaluations, shard-window members, shard
tables), so a test can prove that resuming costs one window, without a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import numpy as np

from ._permutation import KeyedPermutation

# Stream tags keep the keyed permutations of different purposes independent.
TAG_SAMPLES, TAG_SHARDS, TAG_WINDOW, TAG_ORDER = 1, 2, 3, 4
_CACHED = 2  # epochs and shard windows kept computed: a step that straddles a boundary alternates between two


class SampleStream:
    """The shuffled sample stream of every epoch for one index, seed and shuffle mode."""

    def __init__(
        self,
        num_samples: int,
        seed: int,
        shuffle: Literal["permutation", "shard_block", "none"],
        *,
        shards_per_window: int = 1,
        shard_sizes: np.ndarray | None = None,
        by_shard: np.ndarray | None = None,
    ) -> None:
        self.num_samples, self.seed, self.shuffle, self.shards_per_window = (
            num_samples,
            seed,
            shuffle,
            shards_per_window,
        )
        self.shard_starts = np.zeros(1, dtype=np.int64)
        if shuffle == "shard_block":
            if shard_sizes is None or by_shard is None:
                raise ValueError("shuffle='shard_block' needs the index's shard sizes and by-shard order")
            self.shard_starts = np.concatenate([[0], np.cumsum(shard_sizes, dtype=np.int64)])
            if self.shard_starts[-1] != num_samples:
                raise ValueError("shard sizes do not add up to the number of samples")
        self._by_shard = by_shard
        self._epochs: OrderedDict[int, object] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.work = 0

    def slice(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of ``epoch``'s stream."""
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"stream slice [{start}, {stop}) outside [0, {self.num_samples})")
        if self.shuffle == "none":
            self.work += stop - start
            return np.arange(start, stop, dtype=np.int64)
        if self.shuffle == "permutation":
            permutation = self._epoch_state(epoch)
            assert isinstance(permutation, KeyedPermutation)
            before = permutation.evaluations
            result = permutation(np.arange(start, stop, dtype=np.int64))
            self.work += permutation.evaluations - before
            return result
        return self._shard_block_slice(epoch, start, stop)

    def slices(self, epoch: int, runs: list[tuple[int, int]]) -> list[np.ndarray]:
        """`slice` of each ``(start, stop)`` in ``runs``; a permutation's in one evaluation of the network (a call
        costs ~0.15 ms whatever its size: a rank's micro-batches of a step are evaluated together)."""
        if self.shuffle != "permutation" or len(runs) < 2:
            return [self.slice(epoch, start, stop) for start, stop in runs]
        offsets = np.concatenate([np.arange(start, stop, dtype=np.int64) for start, stop in runs])
        if offsets.size and (offsets.min() < 0 or offsets.max() >= self.num_samples):
            raise IndexError(f"stream slices {runs} outside [0, {self.num_samples})")
        permutation = self._epoch_state(epoch)
        assert isinstance(permutation, KeyedPermutation)
        before = permutation.evaluations
        mapped = permutation(offsets)
        self.work += permutation.evaluations - before
        return np.split(mapped, np.cumsum([stop - start for start, stop in runs])[:-1])

    def shard_window_starts(self, epoch: int) -> np.ndarray:
        """``shard_block``: the stream offset where each shard window of ``epoch`` starts, and the end."""
        state = self._epoch_state(epoch)
        assert isinstance(state, tuple)
        return state[1]

    def _epoch_state(self, epoch: int) -> object:  # KeyedPermutation | (shard order, window starts)
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
        else:
            if self.shuffle == "permutation":
                state: object = KeyedPermutation(self.num_samples, [self.seed, epoch, TAG_SAMPLES])
            else:
                shards = len(self.shard_starts) - 1
                order = KeyedPermutation(shards, [self.seed, epoch, TAG_SHARDS])(np.arange(shards))
                sizes = np.diff(self.shard_starts)[order]
                per = self.shards_per_window
                window_sizes = np.add.reduceat(sizes, np.arange(0, shards, per)) if shards else sizes
                state = (order, np.concatenate([[0], np.cumsum(window_sizes)]))
                self.work += shards
            _remember(self._epochs, epoch, state)
        return self._epochs[epoch]

    def _shard_block_slice(self, epoch: int, start: int, stop: int) -> np.ndarray:
        state = self._epoch_state(epoch)
        assert isinstance(state, tuple)
        order, window_starts = state
        pieces = []
        window = int(np.searchsorted(window_starts, start, side="right")) - 1
        while start < stop:
            members = self._window(epoch, window, order)
            lo = start - window_starts[window]
            hi = min(stop, window_starts[window + 1]) - window_starts[window]
            pieces.append(members[lo:hi])
            start += hi - lo
            window += 1
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)

    def _window(self, epoch: int, window: int, order: np.ndarray) -> np.ndarray:
        if (epoch, window) in self._windows:
            self._windows.move_to_end((epoch, window))
            return self._windows[(epoch, window)]
        per, by_shard = self.shards_per_window, self._by_shard
        assert by_shard is not None  # shuffle='shard_block' refuses a stream without it
        shards = order[window * per : (window + 1) * per]
        members = np.concatenate(
            [np.asarray(by_shard[self.shard_starts[s] : self.shard_starts[s + 1]]) for s in shards]
        )
        shuffle = KeyedPermutation(len(members), [self.seed, epoch, TAG_WINDOW, window])
        members = members[shuffle(np.arange(len(members)))]
        self.work += len(members)
        _remember(self._windows, (epoch, window), members)
        return members


def _remember(cache: OrderedDict, key: object, value: object, size: int = _CACHED) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)
