"""What a run reports about its batches: padding per stream, pack fill, and DP balance.

All functions are pure and cheap enough to run on every step's micro-batches; they take ids
that are positions into the given length arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ._pack import Pack


def padding_fraction(micro_batches: Sequence[np.ndarray], lengths: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per stream, the fraction of the padded tensors' slots that are padding.

    A micro-batch of ``n`` ids is padded, per stream, to an ``n × max`` tensor, ``max`` the
    longest member: samples lacking the stream (length 0) still own a row, all padding, and a
    micro-batch where every member lacks it has no tensor (``max`` 0, nothing counted). So a
    stream's fraction is ``1 - sum(lengths) / sum(n × max)`` over the micro-batches; a stream
    with no positive length in any micro-batch is omitted. Empty micro-batches count nothing.
    """
    batches = [np.asarray(batch, dtype=np.int64).ravel() for batch in micro_batches]
    batches = [batch for batch in batches if batch.size]
    if not batches:
        return {}
    ids = np.concatenate(batches)
    sizes = np.array([batch.size for batch in batches], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes[:-1])])
    fractions: dict[str, float] = {}
    for stream, values in lengths.items():
        chosen = np.asarray(values, dtype=np.float64)[ids]
        used = float(chosen.sum())
        if used <= 0:
            continue
        slots = float(np.sum(sizes * np.maximum.reduceat(chosen, starts)))
        fractions[stream] = 1.0 - used / slots
    return fractions


def pack_padding_fraction(packs: Sequence[Pack], capacity: int) -> float:
    """Fraction of the packs' slots left empty: ``1 - sum(lengths) / (len(packs) × capacity)``.

    0.0 for no packs; raises ValueError for ``capacity < 1``.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if not packs:
        return 0.0
    return 1.0 - sum(pack.length for pack in packs) / (len(packs) * capacity)


def balance(step_costs: Sequence[Sequence[float]]) -> dict[str, float]:
    """DP balance: per step, max/mean of the costs its ranks receive; worst and mean over steps.

    A step with no costs or only zero costs counts as perfectly balanced (1.0); so does no
    step at all. Returns ``{"worst": ..., "mean": ...}``.
    """
    ratios: list[float] = []
    for costs in step_costs:
        values = np.asarray(costs, dtype=np.float64)
        mean = float(values.mean()) if values.size else 0.0
        ratios.append(float(values.max()) / mean if mean > 0 else 1.0)
    if not ratios:
        return {"worst": 1.0, "mean": 1.0}
    return {"worst": max(ratios), "mean": float(np.mean(ratios))}


def costliest(costs: Sequence[float], n: int) -> list[int]:
    """Indices of the ``n`` largest costs, largest first, ties by index (a worst-batch probe).

    Raises ValueError for ``n < 0``; ``n`` beyond the number of costs returns all indices.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    values = np.asarray(costs, dtype=np.float64)
    order = np.argsort(-values, kind="stable")
    return [int(i) for i in order[:n]]
