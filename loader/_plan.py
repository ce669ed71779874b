"""The plan: a deterministic, world-size-independent global sequence of micro-batches.

For an index (its fingerprint and size), a ``PlanConfig`` and an epoch, the
micro-batch sequence is a pure function. Epochs chain into one endless
sequence numbered by a *global micro-batch index* ``g = epoch * M + j``, where
``M`` is the number of micro-batches in every epoch and ``j`` the micro-batch's
place within its epoch. Each epoch's *sample stream* is a shuffled order of all
positions; micro-batch ``j`` is the stream's slice ``[j*B, (j+1)*B)``, so the
last micro-batch of an epoch may be short (or dropped with ``drop_last``).

Shuffles:

- ``permutation``: stream[i] = a keyed permutation of ``range(N)`` keyed by
  (seed, epoch): O(1) work and no memory per position.
- ``shard_block``: shards in a keyed shuffled order, grouped into windows of
  ``shards_per_window`` shards; the window's samples shuffled within it. Reading
  stays sequential within a few shards. Locating a stream slice costs O(shards)
  once per epoch plus O(window).
- ``none``: index order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ._config import PlanConfig
from ._permutation import KeyedPermutation

if TYPE_CHECKING:
    from ._index import SampleIndex

# Stream tags keep the keyed permutations of different purposes independent.
_TAG_SAMPLES, _TAG_SHARDS, _TAG_WINDOW = 1, 2, 3
_CACHED = 2  # epochs and windows kept computed


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of the global sequence: its epoch, its place in that epoch, its sample positions."""

    epoch: int
    index: int
    positions: np.ndarray


class Plan:
    """The global micro-batch sequence for one index and one ``PlanConfig``."""

    def __init__(
        self,
        num_samples: int,
        config: PlanConfig,
        *,
        index_fingerprint: str,
        shard_sizes: np.ndarray | None = None,
        by_shard: np.ndarray | None = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("the plan needs at least one sample; the index is empty")
        self.num_samples = num_samples
        self.config = config
        self.index_fingerprint = index_fingerprint
        self.config_fingerprint = config.fingerprint()
        batch = config.batch_size
        self.micro_batches_per_epoch = num_samples // batch if config.drop_last else -(-num_samples // batch)
        if self.micro_batches_per_epoch == 0:
            raise ValueError(
                f"drop_last with batch_size {batch} drops the whole epoch of {num_samples} samples; "
                "lower batch_size or turn drop_last off"
            )
        self.dropped_per_epoch = num_samples - self.micro_batches_per_epoch * batch if config.drop_last else 0
        if config.shuffle == "shard_block":
            if shard_sizes is None or by_shard is None:
                raise ValueError("shuffle='shard_block' needs the index's shard sizes and by-shard order")
            self._shard_starts = np.concatenate([[0], np.cumsum(shard_sizes, dtype=np.int64)])
            if self._shard_starts[-1] != num_samples:
                raise ValueError("shard sizes do not add up to the number of samples")
            self._by_shard = by_shard
        # A step that straddles an epoch or window boundary alternates between two of each.
        self._epochs: OrderedDict[int, object] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.work = 0  # positions computed so far (permutation evaluations and window members)

    @classmethod
    def from_index(cls, index: SampleIndex, config: PlanConfig) -> Plan:
        """The plan of ``config`` over an opened index."""
        return cls(
            index.num_samples, config, index_fingerprint=index.fingerprint,
            shard_sizes=index.shard_sizes, by_shard=index.by_shard,
        )

    def global_index(self, epoch: int, index: int) -> int:
        """Global micro-batch index of micro-batch ``index`` of ``epoch``."""
        return epoch * self.micro_batches_per_epoch + index

    def locate(self, global_index: int) -> tuple[int, int]:
        """(epoch, index within epoch) of a global micro-batch index."""
        if global_index < 0:
            raise IndexError(f"global micro-batch index must be >= 0, got {global_index}")
        return divmod(global_index, self.micro_batches_per_epoch)

    def micro_batch(self, global_index: int) -> MicroBatch:
        """The micro-batch at ``global_index``: O(batch size) work, or O(window) in shard-block mode."""
        epoch, index = self.locate(global_index)
        start = index * self.config.batch_size
        stop = min(start + self.config.batch_size, self.num_samples)
        return MicroBatch(epoch=epoch, index=index, positions=self.stream(epoch, start, stop))

    def stream(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of ``epoch``'s shuffled sample stream."""
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"stream slice [{start}, {stop}) outside [0, {self.num_samples})")
        mode = self.config.shuffle
        if mode == "none":
            self.work += stop - start
            return np.arange(start, stop, dtype=np.int64)
        if mode == "permutation":
            permutation = self._epoch_state(epoch)
            before = permutation.evaluations
            result = permutation(np.arange(start, stop, dtype=np.int64))
            self.work += permutation.evaluations - before
            return result
        return self._shard_block_stream(epoch, start, stop)

    def _epoch_state(self, epoch: int):  # -> KeyedPermutation | (shard order, window starts)
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
        else:
            seed = self.config.seed
            if self.config.shuffle == "permutation":
                state: object = KeyedPermutation(self.num_samples, [seed, epoch, _TAG_SAMPLES])
            else:
                shards = len(self._shard_starts) - 1
                order = KeyedPermutation(shards, [seed, epoch, _TAG_SHARDS])(np.arange(shards))
                sizes = np.diff(self._shard_starts)[order]
                per = self.config.shards_per_window
                window_sizes = np.add.reduceat(sizes, np.arange(0, shards, per)) if shards else sizes
                state = (order, np.concatenate([[0], np.cumsum(window_sizes)]))
                self.work += shards
            _remember(self._epochs, epoch, state)
        return self._epochs[epoch]

    def _shard_block_stream(self, epoch: int, start: int, stop: int) -> np.ndarray:
        order, window_starts = self._epoch_state(epoch)
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
        per = self.config.shards_per_window
        shards = order[window * per : (window + 1) * per]
        members = np.concatenate(
            [np.asarray(self._by_shard[self._shard_starts[s] : self._shard_starts[s + 1]]) for s in shards]
        )
        shuffle = KeyedPermutation(len(members), [self.config.seed, epoch, _TAG_WINDOW, window])
        members = members[shuffle(np.arange(len(members)))]
        self.work += len(members)
        _remember(self._windows, (epoch, window), members)
        return members


def _remember(cache: OrderedDict, key: object, value: object, size: int = _CACHED) -> None:
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)
