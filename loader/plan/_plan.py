"""The plan: a deterministic, world-size-independent global sequence of micro-batches.

For an index (its fingerprint and size), a ``PlanConfig`` and an epoch, each epoch has a
*sample stream* (`_stream.SampleStream`): a shuffled order of all positions.

The stream is cut into *windows* (``window_size`` samples, or one shard window; in budget mode
the epoch is cut into windows of equal size, so its last is not a small remainder). A window's
micro-batches are a pure function of (epoch, window, where it starts in the stream, the
budget, the ids carried in): fixed-size chunks, or length-bucketed micro-batches filled to a
cost budget, or packs (``omnifeed.bucketing``). Only a window's last micro-batch may borrow
the next few samples of the stream to fill up, and the next window starts after them. In
budget mode a window's light micro-batches (leftovers that found no room among their own
modality mix) are *carried*: their samples join the next window's own (at most
``bucketing.carry`` of them; never out of an epoch's last window), so only the epoch's end
deals a light micro-batch beside full ones. The cursor is (epoch, window, window start, the
ids carried in, offset) and resuming computes one window. Epochs chain into one endless
sequence.

Budget mode without explicit edges sizes its default window and its buckets from the data
(`omnifeed.bucketing.choose_window_layout`): the smallest window (65,536 to 524,288 samples)
in which every stream is estimated to pad under 2.7 %, each modality mix's secondary streams
cut into as many cells as that window's micro-batches of the mix bear.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
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
    even_order,
    pack_window,
    stream_lengths,
)

from .._errors import OmnifeedError
from ..index import MixtureIndex, even_positions
from ._bucket_plan import BucketPlan, bucket_plan
from ._config import PlanConfig
from ._micro_batch import _NOTHING, LengthSource, MicroBatch, WindowPlan
from ._mixture import MixtureStream, mixture_stream
from ._permutation import KeyedPermutation
from ._stream import TAG_ORDER, SampleStream

if TYPE_CHECKING:
    from ..index import SampleIndex

# Default windows: fixed-size batches need no more than a few micro-batches' worth; bucketing fills
# micro-batches tightly only when a window holds thousands of them (`_bucket_plan`).
_FIXED_WINDOW_BATCHES, _BUCKETED_WINDOW = 64, 65536


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
        mixture: MixtureStream | None = None,
        even_lengths: Callable[[int], Mapping[str, np.ndarray]] | None = None,
        index_path: str | Path | None = None,
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
        self.mixture = mixture
        self._stream: SampleStream | MixtureStream = mixture or SampleStream(
            num_samples,
            config.seed,
            config.shuffle,
            shards_per_window=config.shards_per_window,
            shard_sizes=shard_sizes,
            by_shard=by_shard,
        )
        self._shard_sizes, self._by_shard = shard_sizes, by_shard  # kept for with_config
        self._lengths = lengths
        self._even_lengths = even_lengths  # the index's stored even sample of lengths (`SampleIndex.even_lengths`)
        self.index_path = None if index_path is None else Path(index_path)  # where epochs written ahead are found
        self._describe = describe or (lambda position: f"position {position}")
        self._equal_windows = bool(
            self.bucketing and self.bucketing.mode == "budget" and config.shuffle != "shard_block"
        )
        self._bucket_plan = BucketPlan(self.window_size)
        if self.bucketing and self.bucketing.mode == "budget":
            shard_window = self.num_samples / self.windows_per_epoch(0) if config.shuffle == "shard_block" else None
            self._bucket_plan = bucket_plan(
                self.bucketing,
                num_samples,
                self._probe_lengths,
                window_size=config.window_size,
                shard_window=shard_window,
            )
            self.window_size = self._bucket_plan.window

    @classmethod
    def from_index(cls, index: SampleIndex | MixtureIndex, config: PlanConfig) -> Plan:
        """The plan of ``config`` over an opened index (a `MixtureIndex` for a config with a mixture).

        Raises ValueError when the index and the config disagree on being a mixture, or on its sources.
        """
        if config.mixture is not None or isinstance(index, MixtureIndex):
            return cls._of_mixture(index, config)
        return cls(
            index.num_samples,
            config,
            index_fingerprint=index.fingerprint,
            shard_sizes=index.shard_sizes,
            by_shard=index.by_shard,
            lengths=index.length_columns,
            describe=lambda position: f"{index.keys([position])[0]!r} (position {position})",
            even_lengths=index.even_lengths,
            index_path=index.path,
        )

    @classmethod
    def _of_mixture(cls, index: SampleIndex | MixtureIndex, config: PlanConfig) -> Plan:
        if config.mixture is None or not isinstance(index, MixtureIndex):
            raise ValueError(
                "a mixture index needs plan.mixture, and plan.mixture a mixture index: open it with "
                "open_mixture(config.plan.mixture) (Feed and the service do when given no index)"
            )
        if list(config.mixture.sources) != index.names:
            raise ValueError(f"plan.mixture's sources {list(config.mixture.sources)} are not the index's {index.names}")
        stream = mixture_stream(config.mixture, index.sizes.tolist(), config.seed)
        return cls(
            stream.num_samples,
            config,
            index_fingerprint=index.fingerprint,
            lengths=index.length_columns,
            describe=lambda position: f"{index.keys([position])[0]!r} (position {position})",
            mixture=stream,
        )

    def with_config(self, config: PlanConfig) -> Plan:
        """The plan of another config over the same index (its lengths, shards and sample names)."""
        mixture = self.mixture
        if mixture is not None and config.mixture is not None:
            mixture = mixture_stream(config.mixture, mixture.schedule.sizes.tolist(), config.seed)
        return Plan(
            mixture.num_samples if mixture is not None else self.num_samples,
            config,
            index_fingerprint=self.index_fingerprint,
            shard_sizes=self._shard_sizes,
            by_shard=self._by_shard,
            lengths=self._lengths,
            describe=self._describe,
            mixture=mixture,
            even_lengths=self._even_lengths,
            index_path=self.index_path,
        )

    @property
    def budget(self) -> float | None:
        """The configured budget (None for fixed-size batches)."""
        return self.bucketing.budget if self.bucketing else None

    @property
    def work(self) -> int:
        """Positions computed so far (permutation evaluations, shard tables and window members)."""
        return self._stream.work

    @property
    def _shard_starts(self) -> np.ndarray:
        return self._stream.shard_starts

    def stream_lengths(self, positions: np.ndarray, cost: CostModel | None = None) -> dict[str, np.ndarray]:
        """Per-stream lengths (tokens, patches, ...) of the samples at ``positions`` under ``cost``
        (default: the bucketing cost model, else the default one)."""
        if self._lengths is None:
            raise ValueError("this plan has no length source")
        return stream_lengths(
            self._lengths(positions), cost or (self.bucketing.cost if self.bucketing else CostModel())
        )

    def _probe_lengths(self, size: int) -> dict[str, np.ndarray]:
        """Stream lengths of an even sample of ``size`` positions of the index (what buckets are estimated from)."""
        # a mixture's probe is of its sources' samples, not of its weights: a weight change keeps the buckets, so the
        # window in progress forms the same micro-batches after it (`change_mixture`)
        if self.mixture is None and self._even_lengths is not None:
            return stream_lengths(self._even_lengths(size), self.bucketing.cost if self.bucketing else CostModel())
        total = self.mixture.total_samples if self.mixture is not None else self.num_samples
        return self.stream_lengths(even_positions(total, size))

    @property
    def layout(self) -> MixLayout | None:
        """Budget mode's buckets per modality mix (their estimated padding per stream in ``layout.estimate``), or
        None."""
        return self._bucket_plan.layout

    @property
    def edges(self) -> dict[str, np.ndarray]:
        """Budget mode's grid edges per stream, when ``edges`` or ``bucket_streams`` are configured."""
        return self._bucket_plan.edges

    def windows_per_epoch(self, epoch: int) -> int:
        """How many windows the epoch's stream is cut into (before any borrowing)."""
        if self.config.shuffle == "shard_block":
            assert isinstance(self._stream, SampleStream)  # a mixture is a permutation (its config says so)
            return len(self._stream.shard_window_starts(epoch)) - 1
        return -(-self.num_samples // self.window_size)

    def _nominal_end(self, epoch: int, window: int) -> int:
        windows = self.windows_per_epoch(epoch)
        if window >= windows:
            return self.num_samples
        if self.config.shuffle == "shard_block":
            assert isinstance(self._stream, SampleStream)
            return int(self._stream.shard_window_starts(epoch)[window + 1])
        if self._equal_windows:  # windows of equal size (within one sample): the last is no small remainder
            return (window + 1) * self.num_samples // windows
        return min((window + 1) * self.window_size, self.num_samples)

    def window_reach(self, epoch: int, window: int, start: int) -> int:
        """The stream offset past every sample that window ``window`` (starting at ``start``) reads: its own and the
        ones it may borrow; what it forms depends on nothing beyond."""
        return max(start, self._nominal_end(epoch, window)) + self._lookahead()

    @property
    def carry_limit(self) -> int:
        """The most samples a window carries into the next: ``bucketing.carry``, at most a window's worth (0 unless
        budget mode)."""
        bucketing = self.bucketing
        return min(bucketing.carry, self.window_size) if bucketing is not None and bucketing.mode == "budget" else 0

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
        carry = _NOTHING
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
            carry_limit = self.carry_limit if own_end < self.num_samples else 0  # nothing carries out of an epoch
            batches, costs, consumed, carry = self._budget(
                own, look, budget, carry_limit, own_end + len(look) >= self.num_samples
            )
            packs = [None] * len(batches)
        next_start = own_end + consumed
        last = next_start >= self.num_samples
        if self.bucketing is not None and len(batches) > 1:
            order = self._deal_order(epoch, window, costs, budget, last)
            if self.mixture is not None and self.config.mixture is not None and self.config.mixture.interleave:
                order = self.mixture.interleave([batches[i] for i in order], order)
            batches, costs, packs = [batches[i] for i in order], [costs[i] for i in order], [packs[i] for i in order]
        micro_batches = tuple(
            MicroBatch(epoch, first_index + i, window, b, c, p, last and i == len(batches) - 1)
            for i, (b, c, p) in enumerate(zip(batches, costs, packs))
        )
        return WindowPlan(epoch, window, start, budget, micro_batches, next_start, last, carry)

    def _deal_order(self, epoch: int, window: int, costs: list[float], budget: float | None, last: bool) -> np.ndarray:
        """The window's micro-batches shuffled (lengths interleave), in cost tiers when ``tier_width`` is set."""
        bucketing = self.bucketing
        assert bucketing is not None and budget is not None
        shuffle = KeyedPermutation(len(costs), [self.config.seed, epoch, TAG_ORDER, window])(np.arange(len(costs)))
        if bucketing.tier_width is None:
            return shuffle
        # Tiers alternate direction window by window, so light tails meet light heads and heavy ones meet
        # heavy ones; counted back from the epoch's last window, which runs costliest first: the light
        # micro-batches it cannot carry or bridge then end the epoch.
        descending = last or (self.windows_per_epoch(epoch) - 1 - window) % 2 == 0
        return even_order(np.asarray(costs), budget, bucketing.tier_width, shuffle, descending=descending)

    def _lookahead(self) -> int:
        return self.bucketing.lookahead if self.bucketing else self.config.batch_size

    def _budget(
        self, own: np.ndarray, look: np.ndarray, budget: float | None, carry: int, look_ends_epoch: bool
    ) -> tuple[list[np.ndarray], list[float], int, np.ndarray]:
        bucketing = self.bucketing
        assert bucketing is not None and budget is not None
        lengths, look_lengths = self.stream_lengths(own), self.stream_lengths(look)
        try:
            assembled = assemble_budget(
                own,
                lengths,
                self._bucket_plan.buckets(lengths),
                budget,
                bucketing.cost,
                max_batch_size=bucketing.max_batch_size,
                overlong=bucketing.overlong,  # type: ignore[arg-type]
                lookahead_positions=look,
                lookahead_lengths=look_lengths,
                carry=carry,
                lookahead_ends_epoch=look_ends_epoch,
            )
        except OverBudgetError as exc:
            raise OmnifeedError(
                f"sample {self._describe(exc.position)} costs {exc.cost:g} alone, over the micro-batch budget "
                f"{exc.budget:g}: raise the budget, or set bucketing.overlong to 'alone' and find such samples "
                "with `omnifeed plan --worst N`"
            ) from exc
        return assembled.batches, assembled.costs, assembled.consumed, assembled.carry

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
        return self._stream.slice(epoch, start, stop)

    def streams(self, epoch: int, runs: list[tuple[int, int]]) -> list[np.ndarray]:
        """`stream` of each ``(start, stop)`` of ``runs``, computed together where the stream allows."""
        if isinstance(self._stream, SampleStream):
            return self._stream.slices(epoch, runs)
        return [self._stream.slice(epoch, start, stop) for start, stop in runs]
