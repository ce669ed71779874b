"""Bucket edges estimated from data, and the bucket grid samples are assigned to.

Edges are *inclusive upper bounds*: with edges ``e`` a present sample of length ``L`` lies in
bucket ``searchsorted(e, L, side="left")``, i.e. bucket ``i`` holds ``e[i-1] < L <= e[i]``
and the last bucket holds ``L > e[-1]``. A length of 0 means the sample lacks the stream.

Several streams bucket together on a grid: per stream, cell 0 holds the samples that lack it
and cells ``1 … len(edges) + 1`` its length buckets; a sample's bucket id is the row-major
flattening of its cells, so ids are stable for given edges (``num_cells`` of them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np


def _split_by_cost(sorted_values: np.ndarray, sorted_costs: np.ndarray, num_buckets: int) -> np.ndarray:
    """Edges where the running cost of the ascending values comes nearest to k/num_buckets of it."""
    cumulative = np.cumsum(sorted_costs, dtype=np.float64)
    total = float(cumulative[-1])
    if total <= 0.0:
        return np.zeros(0, dtype=np.float64)
    targets = total * np.arange(1, num_buckets, dtype=np.float64) / num_buckets
    # the sample whose cost crosses each target, or the one before it when that is nearer
    crossing = np.minimum(np.searchsorted(cumulative, targets, side="left"), sorted_values.size - 1)
    before = np.where(crossing > 0, cumulative[np.maximum(crossing - 1, 0)], 0.0)
    last = np.where(targets - before < cumulative[crossing] - targets, crossing - 1, crossing)
    edges = np.unique(sorted_values[last[last >= 0]])  # -1: nearest is "no sample"
    # an edge at the largest length would leave the last bucket empty
    return np.asarray(edges[edges < sorted_values[-1]], dtype=np.float64)


def estimate_boundaries(
    lengths: np.ndarray,
    num_buckets: int,
    method: Literal["equal_cost", "quantile"] = "equal_cost",
    *,
    costs: np.ndarray | None = None,
) -> np.ndarray:
    """Ascending, unique inclusive upper edges splitting the positive lengths into buckets.

    ``quantile`` gives about equal sample counts per bucket; ``equal_cost`` about equal total
    cost, a sample costing ``costs[i]`` if given (ignored by ``quantile``) else its length
    (like Lhotse's ``estimate_duration_buckets``). Edge ``k`` is the length at which the
    running total, over lengths in ascending order, comes nearest to ``k / num_buckets`` of
    the whole: for distinct lengths, none costing more than a share, each bucket's total is
    within one sample's cost of its share. Lengths ``<= 0`` (absent) are excluded. Degenerate data
    (equal lengths, fewer samples than buckets, nothing present) yields fewer edges.

    Returns float64, at most ``num_buckets - 1`` values. Raises ValueError for
    ``num_buckets < 1``, an unknown method, or ``costs`` of another shape or negative.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    if method not in ("equal_cost", "quantile"):
        raise ValueError(f"method must be 'equal_cost' or 'quantile', got {method!r}")
    values = np.asarray(lengths, dtype=np.float64).ravel()
    if costs is not None:
        weights = np.asarray(costs, dtype=np.float64).ravel()
        if weights.shape != values.shape:
            raise ValueError(f"costs has {weights.size} values for {values.size} lengths")
        if np.any(weights < 0):
            raise ValueError("costs must be non-negative")
    present = values > 0
    values = values[present]
    if num_buckets == 1 or values.size == 0:
        return np.zeros(0, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    if method == "quantile":
        per_sample = np.ones(values.size, dtype=np.float64)
    elif costs is not None:
        per_sample = weights[present][order]
    else:
        per_sample = values[order]
    return _split_by_cost(values[order], per_sample, num_buckets)


def num_cells(edges: Mapping[str, np.ndarray]) -> int:
    """Number of bucket ids on the grid of ``edges``: the product of ``len(edges[s]) + 2``."""
    count = 1
    for stream_edges in edges.values():
        count *= len(stream_edges) + 2
    return count


def assign_buckets(lengths: Mapping[str, np.ndarray], edges: Mapping[str, np.ndarray]) -> np.ndarray:
    """Bucket id per sample (int64) on the grid of the streams in ``edges``, in its order.

    Per stream ``s`` the cell is 0 for a length ``<= 0`` (absent), else
    ``1 + searchsorted(edges[s], length, side="left")``; the id is the row-major flattening of
    the cells with sizes ``len(edges[s]) + 2``. Streams of ``lengths`` not in ``edges`` are
    ignored. Raises ValueError when a stream of ``edges`` has no lengths or shapes differ.
    """
    missing = [stream for stream in edges if stream not in lengths]
    if missing:
        raise ValueError(f"no lengths for bucketed stream(s) {missing}")
    shapes = {np.shape(lengths[stream]) for stream in edges}
    if len(shapes) > 1:
        raise ValueError(f"bucketed streams have lengths of different shapes: {sorted(shapes)}")
    if shapes:
        shape = shapes.pop()
    else:
        shape = np.shape(next(iter(lengths.values()))) if lengths else (0,)
    ids = np.zeros(shape, dtype=np.int64)
    for stream, stream_edges in edges.items():
        values = np.asarray(lengths[stream])
        bounds = np.asarray(stream_edges, dtype=np.float64)
        cell = np.where(values > 0, 1 + np.searchsorted(bounds, values, side="left"), 0)
        ids = ids * (bounds.size + 2) + cell
    return ids


def choose_bucket_streams(
    lengths: Mapping[str, np.ndarray], weights: Mapping[str, float], max_streams: int = 2
) -> list[str]:
    """The at most ``max_streams`` streams of largest total weighted length, largest first.

    A stream's total is ``weights.get(s, 0) * sum(lengths[s])``; streams whose total is 0 are
    never chosen; ties keep the order of ``lengths``. Raises ValueError for ``max_streams < 0``.
    """
    if max_streams < 0:
        raise ValueError(f"max_streams must be >= 0, got {max_streams}")
    totals = {
        stream: float(weights.get(stream, 0.0)) * float(np.sum(values, dtype=np.float64))
        for stream, values in lengths.items()
    }
    ranked = sorted((stream for stream, total in totals.items() if total > 0), key=lambda s: -totals[s])
    return ranked[:max_streams]
