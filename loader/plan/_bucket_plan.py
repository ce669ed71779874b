"""How a budget-mode plan puts samples into buckets: its window and its layout, chosen from the data, or grid edges.

`bucket_plan` runs once, when a plan is built, over an even probe of the index's lengths:

- neither ``edges`` nor ``bucket_streams`` set (the default): buckets per modality mix with
  secondary cells chosen from the data (`omnifeed.bucketing.estimate_mix_layout`), and, with
  ``window_size`` unset, the smallest window from about 6,144 micro-batches' worth (issue 20)
  doubling up to 524,288 samples or the epoch whose estimate is under `PADDING_TARGET` in every
  stream (`omnifeed.bucketing.choose_window_layout`, issue 29);
- otherwise: a grid of per-stream edges, given or estimated, in a window of ~6,144 micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from omnifeed.bucketing import (
    BucketingConfig,
    MixLayout,
    assign_buckets,
    choose_bucket_streams,
    choose_window_layout,
    estimate_boundaries,
    estimate_mix_layout,
    mix_buckets,
    sample_costs,
)

EDGE_SAMPLE = 65536  # samples read to estimate grid edges (the layout reads as many as its largest window)
BUCKETED_WINDOW, WINDOW_MICRO_BATCHES, MAX_WINDOW = 65536, 6144, 1 << 19
PADDING_TARGET = 0.027  # the padding per stream default windows and cells are chosen to stay under


@dataclass(frozen=True)
class BucketPlan:
    """A budget-mode plan's buckets: a layout per modality mix, or grid ``edges``; and the window they were sized
    for."""

    window: int
    layout: MixLayout | None = None
    edges: dict[str, np.ndarray] = field(default_factory=dict)

    def buckets(self, lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        """Bucket id per sample: its mix and secondary cells, or its grid cell, except that on a grid a sample with a
        single stream is bucketed by that presence alone (the fill sorts a bucket by cost, the best one-dimensional
        bucketing there is; finer cells would only leave more partly filled micro-batches)."""
        if self.layout is not None:
            return mix_buckets(lengths, self.layout)
        cells = assign_buckets(lengths, self.edges)
        present = (
            np.stack([lengths[s] > 0 for s in self.edges], axis=1) if self.edges else np.zeros((len(cells), 0), bool)
        )
        mask = (present.astype(np.int64) << np.arange(present.shape[1], dtype=np.int64)).sum(axis=1)
        return np.where(present.sum(axis=1) == 1, -1 - mask, cells)


def _smallest_window(probe: Mapping[str, np.ndarray], bucketing: BucketingConfig) -> int:
    """About `WINDOW_MICRO_BATCHES` micro-batches' worth of samples (the budget over the mean sample cost), 65,536 to
    524,288."""
    mean = float(np.mean(sample_costs(probe, bucketing.cost)))
    per_batch = bucketing.budget / max(mean, 1e-9)
    return int(min(MAX_WINDOW, max(BUCKETED_WINDOW, round(WINDOW_MICRO_BATCHES * per_batch))))


def _grid_edges(probe: Mapping[str, np.ndarray], bucketing: BucketingConfig) -> dict[str, np.ndarray]:
    """Edges on a grid of streams: given in the config, or estimated from the probe (every weighted stream by
    default)."""
    if bucketing.edges is not None:
        return {s: np.asarray(e, dtype=np.float64) for s, e in bucketing.edges.items()}
    streams = bucketing.bucket_streams or choose_bucket_streams(probe, bucketing.cost.weights, max_streams=len(probe))
    return {
        s: estimate_boundaries(
            probe[s], bucketing.num_buckets, bucketing.method, costs=sample_costs({s: probe[s]}, bucketing.cost)
        )
        for s in streams
    }


def bucket_plan(
    bucketing: BucketingConfig,
    num_samples: int,
    probe: Callable[[int], Mapping[str, np.ndarray]],
    *,
    window_size: int | None,
    shard_window: float | None,
) -> BucketPlan:
    """The buckets of a budget-mode plan over ``num_samples`` samples; ``probe(n)``: the lengths of ``n`` even
    positions.

    ``window_size``: the configured window (None: chosen here); ``shard_window``: the mean samples
    of a shard window in ``shard_block`` mode (its windows are shards, not chosen).
    """
    if bucketing.edges is not None or bucketing.bucket_streams is not None:
        lengths = probe(EDGE_SAMPLE)
        return BucketPlan(window_size or _smallest_window(lengths, bucketing), edges=_grid_edges(lengths, bucketing))
    lengths = probe(max(EDGE_SAMPLE, window_size or MAX_WINDOW))  # the layout is estimated at a window's density
    fixed = shard_window if shard_window is not None else window_size
    if fixed is not None:
        window = max(1, int(min(fixed, num_samples)))
        layout = estimate_mix_layout(
            lengths, bucketing.cost, bucketing.budget, window, bucketing.num_buckets, target=PADDING_TARGET
        )
        return BucketPlan(window_size or BUCKETED_WINDOW, layout=layout)
    windows, window = [], _smallest_window(lengths, bucketing)
    while True:  # doubling from the issue-20 size; a window of the whole epoch is the last worth trying
        windows.append(window)
        if window >= min(MAX_WINDOW, num_samples):
            break
        window = min(2 * window, MAX_WINDOW)
    clipped = [min(w, num_samples) for w in windows]
    layout = choose_window_layout(
        lengths, bucketing.cost, bucketing.budget, clipped, bucketing.num_buckets, target=PADDING_TARGET
    )
    chosen = windows[clipped.index(layout.window)]
    return BucketPlan(chosen, layout=replace(layout, window=chosen))
