"""The plan: a deterministic, world-size-independent global sequence of micro-batches.

For an index (its fingerprint and size), a ``PlanConfig`` and an epoch, each epoch has a
*sample stream*: a shuffled order of all positions.

- ``permutation``: stream[i] = a keyed permutation of ``range(N)`` keyed by (seed, epoch):
  O(1) work and no memory per position.
- ``shard_block``: shards in a keyed shuffled order, grouped into windows of
  ``shards_per_window`` shards; each window's samples shuffled within it. Reading stays
  sequential within a few shards. Locating a stream slice costs O(shards) once per epoch.
- ``none``: index order.

The stream is cut into *windows* (``window_size`` samples, or one shard window). A window's
micro-batches are a pure function of (epoch, window, where it starts in the stream, the
budget): fixed-size chunks, or length-bucketed micro-batches filled to a cost budget, or
packs (``omnifeed.bucketing``). Only a window's last micro-batch may borrow the next few
samples of the stream to fill up, and the next window starts after them. In budget mode a
window's light micro-batches (leftovers that found no room) are *carried*: their samples
join the next window's own (at most ``bucketing.carry`` of them; never out of an epoch's
last window), so only the epoch's end deals a light micro-batch beside full ones. The cursor
is (epoch, window, window start, the ids carried in, offset) and resuming computes one
window. Epochs chain into one endless sequence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from omnifeed.bucketing import (
    CostModel,
    MixLayout,
    OverBudgetError,
    OverlongSampleError,
    Pack,
    assemble_budget,
    assemble_fixed,
    assign_buckets,
    choose_bucket_streams,
    estimate_boundaries,
    estimate_mix_layout,
    even_order,
    light_to_carry,
    mix_buckets,
    pack_window,
    sample_costs,
    stream_lengths,
)

from .._errors import OmnifeedError
from ._config import PlanConfig
from ._micro_batch import MicroBatch, WindowPlan
from ._permutation import KeyedPermutation

if TYPE_CHECKING:
    from ..index._sample_index import SampleIndex

# Stream tags keep the keyed permutations of different purposes independent.
_TAG_SAMPLES, _TAG_SHARDS, _TAG_WINDOW, _TAG_ORDER = 1, 2, 3, 4
_CACHED = 2  # epochs and shard windows kept computed
_EDGE_SAMPLE = 65536  # samples read to estimate bucket edges
# Default windows: fixed-size batches need no more than a few micro-batches' worth; bucketing
# fills micro-batches tightly only when a window holds thousands of them: each bucket leaves one
# partly filled, so budget mode sizes its window for ~6,144 micro-batches (docs/bench.md, issue 20).
_FIXED_WINDOW_BATCHES, _BUCKETED_WINDOW, _WINDOW_MICRO_BATCHES, _MAX_WINDOW = 64, 65536, 6144, 1 << 19

_NOTHING = np.empty(0, dtype=np.int64)
_NOTHING.flags.writeable = False

LengthSource = Callable[[np.ndarray], Mapping[str, np.ndarray]]
"""Positions -> the index's length columns (``text_tokens``, ``image_width``, ...) at those positions."""


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
        lengths: LengthSource | None = None,
        describe: Callable[[int], str] | None = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("the plan needs at least one sample; the index is empty")
        self.num_samples = num_samples
        self.config = config
        self.index_fingerprint = index_fingerprint
        self.config_fingerprint = config.fingerprint()
        self.bucketing = config.bucketing
        batch = config.batch_size
        if self.bucketing is None:
            window = config.window_size or _FIXED_WINDOW_BATCHES * batch
            self.window_size = -(-window // batch) * batch  # whole micro-batches
            if config.drop_last and num_samples < batch:
                raise ValueError(
                    f"drop_last with batch_size {batch} drops the whole epoch of {num_samples} samples; "
                    "lower batch_size or turn drop_last off"
                )
        else:
            if lengths is None:
                raise ValueError("bucketing needs the index's lengths (Plan.from_index provides them)")
            self.window_size = config.window_size or _BUCKETED_WINDOW
        self.dropped_per_epoch = num_samples % batch if config.drop_last and self.bucketing is None else 0
        if config.shuffle == "shard_block":
            if shard_sizes is None or by_shard is None:
                raise ValueError("shuffle='shard_block' needs the index's shard sizes and by-shard order")
            self._shard_starts = np.concatenate([[0], np.cumsum(shard_sizes, dtype=np.int64)])
            if self._shard_starts[-1] != num_samples:
                raise ValueError("shard sizes do not add up to the number of samples")
        self._shard_sizes, self._by_shard = shard_sizes, by_shard  # kept for with_config
        self._lengths = lengths
        self._describe = describe or (lambda position: f"position {position}")
        # A step that straddles an epoch or window boundary alternates between two of each.
        self._epochs: OrderedDict[int, object] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.work = 0  # positions computed so far (permutation evaluations and window members)
        self.edges: dict[str, np.ndarray] = {}
        self.layout: MixLayout | None = None
        if self.bucketing and self.bucketing.mode == "budget":
            if config.window_size is None:
                self.window_size = self._budget_window()
            if self.bucketing.edges is None and self.bucketing.bucket_streams is None:
                self.layout = self._estimate_layout()
            else:
                self.edges = self._resolve_edges()

    @classmethod
    def from_index(cls, index: SampleIndex, config: PlanConfig) -> Plan:
        """The plan of ``config`` over an opened index."""
        return cls(
            index.num_samples,
            config,
            index_fingerprint=index.fingerprint,
            shard_sizes=index.shard_sizes,
            by_shard=index.by_shard,
            lengths=index.length_columns,
            describe=lambda position: f"{index.keys([position])[0]!r} (position {position})",
        )

    def with_config(self, config: PlanConfig) -> Plan:
        """The plan of another config over the same index (its lengths, shards and sample names)."""
        return Plan(
            self.num_samples,
            config,
            index_fingerprint=self.index_fingerprint,
            shard_sizes=self._shard_sizes,
            by_shard=self._by_shard,
            lengths=self._lengths,
            describe=self._describe,
        )

    @property
    def budget(self) -> float | None:
        """The configured budget (None for fixed-size batches)."""
        return self.bucketing.budget if self.bucketing else None

    def stream_lengths(self, positions: np.ndarray, cost: CostModel | None = None) -> dict[str, np.ndarray]:
        """Per-stream lengths (tokens, patches, ...) of the samples at ``positions`` under ``cost``
        (default: the bucketing cost model, else the default one)."""
        if self._lengths is None:
            raise ValueError("this plan has no length source")
        return stream_lengths(
            self._lengths(positions), cost or (self.bucketing.cost if self.bucketing else CostModel())
        )

    def _probe_lengths(self) -> dict[str, np.ndarray]:
        """Stream lengths of an even sample of the index (what bucket edges are estimated from)."""
        probe = np.unique(np.linspace(0, self.num_samples - 1, min(self.num_samples, _EDGE_SAMPLE)).astype(np.int64))
        return self.stream_lengths(probe)

    def _budget_window(self) -> int:
        """The default window in budget mode: about ``_WINDOW_MICRO_BATCHES`` micro-batches' worth of samples
        (the budget over the mean sample cost), at least 65,536 and at most 524,288 samples."""
        bucketing = self.bucketing
        assert bucketing is not None
        mean = float(np.mean(sample_costs(self._probe_lengths(), bucketing.cost)))
        per_batch = bucketing.budget / max(mean, 1e-9)
        return int(min(_MAX_WINDOW, max(_BUCKETED_WINDOW, round(_WINDOW_MICRO_BATCHES * per_batch))))

    def _estimate_layout(self) -> MixLayout:
        """Buckets per modality mix, secondary streams' cells sized for this plan's windows."""
        bucketing = self.bucketing
        assert bucketing is not None
        window = (
            self.num_samples / self.windows_per_epoch(0) if self.config.shuffle == "shard_block" else self.window_size
        )
        return estimate_mix_layout(
            self._probe_lengths(),
            bucketing.cost,
            bucketing.budget,
            max(1, int(min(window, self.num_samples))),
            bucketing.num_buckets,
        )

    def _resolve_edges(self) -> dict[str, np.ndarray]:
        """Bucket edges on a grid of streams: given in the config, or estimated from an even sample of the index."""
        bucketing = self.bucketing
        assert bucketing is not None
        if bucketing.edges is not None:
            return {s: np.asarray(e, dtype=np.float64) for s, e in bucketing.edges.items()}
        lengths = self._probe_lengths()
        # Every weighted stream by default: a cell is then (length bucket or "absent") per stream, so
        # samples of different modality mixes never share a micro-batch (no rows of pure padding)
        # and a sample with two streams (image + text) gets a two-dimensional bucket.
        streams = bucketing.bucket_streams or choose_bucket_streams(
            lengths, bucketing.cost.weights, max_streams=len(lengths)
        )
        return {
            s: estimate_boundaries(
                lengths[s], bucketing.num_buckets, bucketing.method, costs=sample_costs({s: lengths[s]}, bucketing.cost)
            )
            for s in streams
        }

    def windows_per_epoch(self, epoch: int) -> int:
        """How many windows the epoch's stream is cut into (before any borrowing)."""
        if self.config.shuffle == "shard_block":
            return len(self._epoch_state(epoch)[1]) - 1  # type: ignore[index]
        return -(-self.num_samples // self.window_size)

    def _nominal_end(self, epoch: int, window: int) -> int:
        if window >= self.windows_per_epoch(epoch):
            return self.num_samples
        if self.config.shuffle == "shard_block":
            return int(self._epoch_state(epoch)[1][window + 1])  # type: ignore[index]
        return min((window + 1) * self.window_size, self.num_samples)

    @property
    def carry_limit(self) -> int:
        """The most samples a window carries into the next (0 unless budget mode carries)."""
        bucketing = self.bucketing
        return bucketing.carry if bucketing is not None and bucketing.mode == "budget" else 0

    def window(
        self,
        epoch: int,
        window: int,
        start: int,
        *,
        budget: float | None = None,
        first_index: int = 0,
        carried: np.ndarray = _NOTHING,
    ) -> WindowPlan:
        """The micro-batches of ``window`` of ``epoch`` starting at stream offset ``start``, with the ids
        ``carried`` in from the window before (its ``WindowPlan.carry``) placed first."""
        if len(carried) > self.carry_limit:
            raise ValueError(
                f"{len(carried)} samples carried into a window; this plan carries at most {self.carry_limit}"
            )
        own_end = max(start, self._nominal_end(epoch, window))
        own = self.stream(epoch, start, own_end)
        if len(carried):
            own = np.concatenate([np.asarray(carried, dtype=np.int64), own])
        look = self.stream(epoch, own_end, min(own_end + self._lookahead(), self.num_samples))
        budget = budget if budget is not None else self.budget
        packs: list[Pack | None]
        if self.bucketing is None:
            assembled = assemble_fixed(own, self.config.batch_size, look)
            batches, costs, consumed, packs = (
                assembled.batches,
                assembled.costs,
                assembled.consumed,
                [None] * len(assembled.batches),
            )
            if (
                self.dropped_per_epoch
                and own_end + consumed >= self.num_samples
                and len(batches[-1]) < self.config.batch_size
            ):
                batches, costs, packs = batches[:-1], costs[:-1], packs[:-1]
        elif self.bucketing.mode == "packing":
            batches, costs, consumed, packs = self._packs(own, look, budget)
        else:
            batches, costs, consumed = self._budget(own, look, budget)
            packs = [None] * len(batches)
        next_start = own_end + consumed
        carry = _NOTHING
        if self.carry_limit and next_start < self.num_samples:
            assert budget is not None
            moved = light_to_carry(costs, [len(b) for b in batches], budget, self.carry_limit)
            if moved:
                carry = np.concatenate([batches[i] for i in moved])
                kept = sorted(set(range(len(batches))) - set(moved))
                batches, costs, packs = [batches[i] for i in kept], [costs[i] for i in kept], [packs[i] for i in kept]
        if self.bucketing is not None and len(batches) > 1:
            order = self._deal_order(epoch, window, costs, budget, next_start >= self.num_samples)
            batches, costs, packs = [batches[i] for i in order], [costs[i] for i in order], [packs[i] for i in order]
        micro_batches = tuple(
            MicroBatch(epoch, first_index + i, window, b, c, p)
            for i, (b, c, p) in enumerate(zip(batches, costs, packs))
        )
        return WindowPlan(
            epoch, window, start, budget, micro_batches, next_start, next_start >= self.num_samples, carry
        )

    def _deal_order(self, epoch: int, window: int, costs: list[float], budget: float | None, last: bool) -> np.ndarray:
        """The window's micro-batches shuffled (lengths interleave), in cost tiers when ``tier_width`` is set."""
        bucketing = self.bucketing
        assert bucketing is not None and budget is not None
        shuffle = KeyedPermutation(len(costs), [self.config.seed, epoch, _TAG_ORDER, window])(np.arange(len(costs)))
        if bucketing.tier_width is None:
            return shuffle
        # Tiers alternate direction window by window, so light tails meet light heads and heavy ones meet
        # heavy ones; counted back from the epoch's last window, which runs costliest first: the light
        # micro-batches it cannot carry then end the epoch.
        descending = last or (self.windows_per_epoch(epoch) - 1 - window) % 2 == 0
        return even_order(np.asarray(costs), budget, bucketing.tier_width, shuffle, descending=descending)

    def _lookahead(self) -> int:
        return self.bucketing.lookahead if self.bucketing else self.config.batch_size

    def _budget(
        self, own: np.ndarray, look: np.ndarray, budget: float | None
    ) -> tuple[list[np.ndarray], list[float], int]:
        bucketing = self.bucketing
        assert bucketing is not None and budget is not None
        lengths, look_lengths = self.stream_lengths(own), self.stream_lengths(look)
        try:
            assembled = assemble_budget(
                own,
                lengths,
                self._buckets(lengths),
                budget,
                bucketing.cost,
                max_batch_size=bucketing.max_batch_size,
                overlong=bucketing.overlong,  # type: ignore[arg-type]
                lookahead_positions=look,
                lookahead_lengths=look_lengths,
            )
        except OverBudgetError as exc:
            raise OmnifeedError(
                f"sample {self._describe(exc.position)} costs {exc.cost:g} alone, over the micro-batch budget "
                f"{exc.budget:g}: raise the budget, or set bucketing.overlong to 'alone' and find such samples "
                "with `omnifeed plan --worst N`"
            ) from exc
        return assembled.batches, assembled.costs, assembled.consumed

    def _buckets(self, lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        """Bucket ids: the grid cell of the sample's stream lengths, except that a sample with a single
        stream is bucketed by that presence alone: filling sorts a bucket by cost, which is the best
        one-dimensional bucketing there is, and finer cells would only leave more partly filled batches."""
        if self.layout is not None:
            return mix_buckets(lengths, self.layout)
        cells = assign_buckets(lengths, self.edges)
        present = (
            np.stack([lengths[s] > 0 for s in self.edges], axis=1) if self.edges else np.zeros((len(cells), 0), bool)
        )
        mask = (present.astype(np.int64) << np.arange(present.shape[1], dtype=np.int64)).sum(axis=1)
        return np.where(present.sum(axis=1) == 1, -1 - mask, cells)

    def _packs(
        self, own: np.ndarray, look: np.ndarray, budget: float | None
    ) -> tuple[list[np.ndarray], list[float], int, list[Pack | None]]:
        bucketing = self.bucketing
        assert bucketing is not None and budget is not None
        stream = bucketing.pack_stream
        try:
            packs, consumed = pack_window(
                own,
                self.stream_lengths(own)[stream],
                int(budget),
                overlong=bucketing.overlong,  # type: ignore[arg-type]
                lookahead_positions=look,
                lookahead_lengths=self.stream_lengths(look)[stream],
            )
        except OverlongSampleError as exc:
            raise OmnifeedError(
                f"sample {self._describe(exc.position)} has {exc.length} {stream} tokens, over the pack capacity "
                f"{exc.capacity}: raise the budget, or set bucketing.overlong to 'split'"
            ) from exc
        return [p.positions for p in packs], [float(p.length) for p in packs], consumed, list(packs)

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
        per, by_shard = self.config.shards_per_window, self._by_shard
        assert by_shard is not None  # shuffle='shard_block' refuses a plan without it
        shards = order[window * per : (window + 1) * per]
        members = np.concatenate(
            [np.asarray(by_shard[self._shard_starts[s] : self._shard_starts[s + 1]]) for s in shards]
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
