"""Buckets per modality mix: every weighted stream of a micro-batch tight, not only the costliest.

A *mix* is the set of weighted streams a sample has (text only; image + caption; video +
caption + speech; ...). Samples of different mixes never share a bucket (no rows of pure
padding). Within a mix, the *primary* stream is the one that costs the most in total; the
bucket's fill sorts by cost, which the primary dominates, so the primary is tight by sorting.
The other streams of the mix (captions beside images, transcripts beside speech) are
*secondary*: they get length cells of their own, with edges estimated from that mix's samples
alone — not from all text, where documents would put every caption in the first cell.

How many cells: as many as keep each cell's share of a window at ``_BATCHES_PER_CELL``
micro-batches or more (every cell leaves one partly filled micro-batch to the leftover pool),
at most ``num_buckets`` per stream, split evenly (geometric mean) between a mix's secondaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ._buckets import estimate_boundaries
from ._cost import CostModel, sample_costs

_BATCHES_PER_CELL = 16
_MIX_BITS = 20  # a bucket id is (mix mask << _MIX_BITS) + the cell of its secondaries


@dataclass(frozen=True)
class MixLayout:
    """The weighted streams, and per mix (a presence mask over them) its primary and its secondaries' edges."""

    streams: tuple[str, ...]
    primary: dict[int, str] = field(default_factory=dict)
    edges: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)


def mix_masks(lengths: Mapping[str, np.ndarray], streams: tuple[str, ...]) -> np.ndarray:
    """Per sample, the bit mask of the ``streams`` it has (bit ``i`` for ``streams[i]``; int64)."""
    size = len(next(iter(lengths.values()))) if lengths else 0
    mask = np.zeros(size, dtype=np.int64)
    for bit, stream in enumerate(streams):
        mask |= (np.asarray(lengths[stream]) > 0).astype(np.int64) << bit
    return mask


def estimate_mix_layout(
    lengths: Mapping[str, np.ndarray], model: CostModel, budget: float, window: int, num_buckets: int
) -> MixLayout:
    """The layout estimated from an even sample of the index (``lengths``), for windows of ``window`` samples.

    Raises ValueError for a budget, window or ``num_buckets`` that is not positive.
    """
    if budget <= 0 or window < 1 or num_buckets < 1:
        raise ValueError(f"budget, window and num_buckets must be positive, got {budget}, {window}, {num_buckets}")
    streams = tuple(s for s in lengths if model.weight(s) > 0)
    masks = mix_masks(lengths, streams)
    total = max(len(masks), 1)
    primary: dict[int, str] = {}
    edges: dict[int, dict[str, np.ndarray]] = {}
    for mask in np.unique(masks).tolist():
        present = [s for bit, s in enumerate(streams) if mask >> bit & 1]
        if len(present) < 2:
            continue
        members = masks == mask
        costs = {s: sample_costs({s: lengths[s][members]}, model) for s in present}
        primary[mask] = max(present, key=lambda s: (float(costs[s].sum()), -present.index(s)))
        secondaries = [s for s in present if s != primary[mask]]
        per_batch = budget / max(float(sum(c.mean() for c in costs.values())), 1e-9)
        batches_per_window = members.sum() / total * window / max(per_batch, 1.0)
        cells = max(1.0, batches_per_window / _BATCHES_PER_CELL) ** (1.0 / len(secondaries))
        per_stream = int(min(num_buckets, max(1, np.floor(cells))))
        edges[mask] = {s: estimate_boundaries(lengths[s][members], per_stream, "quantile") for s in secondaries}
    return MixLayout(streams, primary, edges)


def mix_buckets(lengths: Mapping[str, np.ndarray], layout: MixLayout) -> np.ndarray:
    """Bucket id per sample (int64): its mix, and for a mix with secondaries the cell of their lengths."""
    masks = mix_masks(lengths, layout.streams)
    cells = np.zeros(len(masks), dtype=np.int64)
    for mask, stream_edges in layout.edges.items():
        members = masks == mask
        if not members.any():
            continue
        cell = np.zeros(int(members.sum()), dtype=np.int64)
        for stream, bounds in stream_edges.items():
            cell = cell * (bounds.size + 1) + np.searchsorted(bounds, np.asarray(lengths[stream])[members], side="left")
        cells[members] = cell
    return (masks << _MIX_BITS) + cells
