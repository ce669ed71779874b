"""A fast estimate of the padding a budget fill leaves, to choose cells and windows from the data.

`assemble_budget` fills each bucket shortest first, one sample at a time (exact, but Python per
sample). Choosing how many cells a secondary stream gets, or how large a window must be, means
trying many layouts on the index's probe, so this module estimates a fill in a few numpy passes,
the way the assembler forms micro-batches: within each bucket, samples sorted by cost are cut
where their running own cost crosses a multiple of the budget (a micro-batch then holds about a
budget's worth of samples of adjacent cost); each bucket's last, partly filled group is pooled
with the others of its pool (its modality mix) and cut again the same way. Each stream's padding
is counted exactly on those groups. The estimate is close where micro-batches hold several
samples, which is where padding comes from; it compares layouts, it never forms micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ._cost import CostModel, sample_costs


def _groups(keys: np.ndarray, costs: np.ndarray, budget: float) -> tuple[np.ndarray, np.ndarray]:
    """Order (by key, then cost) and group id of each sample: cut where the running cost within a key crosses a
    budget."""
    order = np.lexsort([costs, keys])
    key, cost = keys[order], costs[order]
    starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    running = np.cumsum(cost)
    before = np.repeat(np.concatenate([[0.0], running])[starts], np.diff(np.append(starts, key.size)))
    cut = np.floor((running - before - 1e-9 * budget) / budget).astype(np.int64)  # the multiple of the budget crossed
    new = np.concatenate([[True], (key[1:] != key[:-1]) | (cut[1:] != cut[:-1])])
    return order, np.cumsum(new) - 1


def fill_slots(
    lengths: Mapping[str, np.ndarray],
    buckets: np.ndarray,
    budget: float,
    model: CostModel,
    pools: np.ndarray | None = None,
) -> dict[str, tuple[float, float]]:
    """Per stream, ``(used, slots)`` of an estimated fill of ``buckets`` to ``budget`` (padding = 1 - used / slots).

    ``lengths``, ``buckets`` and ``pools`` align (one entry per sample); each bucket's last group
    is pooled with the others of its ``pools`` key (default: one pool for all). A stream no
    sample has is omitted. Raises ValueError for a budget that is not positive.
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    bucket = np.asarray(buckets, dtype=np.int64)
    if bucket.size == 0:
        return {}
    costs = sample_costs(lengths, model)
    order, group = _groups(bucket, costs, budget)
    last = np.zeros(bucket.size, dtype=bool)  # in its bucket's last group: a leftover
    last[order] = _last_group(bucket[order], group)
    pool = np.zeros(bucket.size, dtype=np.int64) if pools is None else np.asarray(pools, dtype=np.int64)
    left = np.flatnonzero(last)
    ids = np.empty(bucket.size, dtype=np.int64)
    ids[order] = group
    if left.size:
        left_order, left_group = _groups(pool[left], costs[left], budget)
        ids[left[left_order]] = left_group + (int(group.max()) + 1)
    members = np.argsort(ids, kind="stable")
    first = np.flatnonzero(np.concatenate([[True], np.diff(ids[members]) != 0]))
    sizes = np.diff(np.append(first, members.size)).astype(np.float64)
    out: dict[str, tuple[float, float]] = {}
    for stream, values in lengths.items():
        ordered = np.asarray(values, dtype=np.float64)[members]
        used = float(ordered.sum())
        if used <= 0:
            continue
        out[stream] = (used, float(np.sum(sizes * np.maximum.reduceat(ordered, first))))
    return out


def _last_group(bucket: np.ndarray, group: np.ndarray) -> np.ndarray:
    """For samples sorted by bucket, whether each is in its bucket's last group."""
    ends = np.append(np.flatnonzero(bucket[1:] != bucket[:-1]), bucket.size - 1)
    final = np.repeat(group[ends], np.diff(np.concatenate([[-1], ends])))
    return group == final


def padding_of(slots: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """Padding fraction per stream from ``(used, slots)`` pairs."""
    return {stream: 1.0 - used / total for stream, (used, total) in slots.items() if total > 0}
