"""Bridges: micro-batches of graded cost that close the gaps in a window's costs, so every run of them is even.

Dealing in cost tiers (`_deal`) makes any ``W`` consecutive micro-batches cost alike only where
the window's costs have no gap: where they jump (clips that cost 0.50 of the budget alone beside
pairs at 0.67, a lone leftover at 0.3 beside full ones at 0.95), the step that straddles the
jump is uneven, whatever the order. So a window's costs are *bridged*: for each jump wider than
2.5 %, micro-batches of a *fluid* bucket (many small samples per micro-batch) are cut anew into
pieces whose costs step across the jump geometrically, the rest of their samples into as few
micro-batches as hold them, none light. Pieces take the shortest samples, in cost order, so they
pad no more than the micro-batches they came from. The bucket that bridges the most is taken (a
whole modality mix, its cells in order, only where it bridges more than any one of its cells);
a jump it cannot pay for whole is bridged from the top, the rest by another bucket in the next
pass. Only over-budget singles (``overlong: alone``) stay out of reach: nothing may cost more
than the budget to bridge up to them.
"""

from __future__ import annotations

import numpy as np

from ._leftovers import _LIGHT, _even_cut, _padded, _scalar_padded, _segments, _uniform, _Weights

_RATIO = 1.025  # bridged costs step by at most this ratio: W consecutive within ~10 % for W up to 8
_FLUID = 8  # a micro-batch of at least this many samples can be cut into pieces
_FULL = 0.85  # a source micro-batch costs at least this fraction of the budget
# budgets' worth of source samples left after the pieces: cut into ceil(left / budget) parts or one more, none light
_SPARE = 4
_GRAIN = 0.05  # a bucket bridges a target only if its short samples cost under this fraction of it
_SHARE = 0.1  # bridges add at most this share to the window's micro-batches (per pass) ...
_FEW = 32  # ... or this many, in a small window
_PASSES = 4
_MIXED = np.iinfo(np.int64).min  # a micro-batch of more than one cell (or mix)


def _jumps(costs: np.ndarray, budget: float) -> list[list[float]]:
    """Per jump wider than `_RATIO` between the sorted costs within the budget, the costs that step across it; widest
    first."""
    values = np.unique(costs[(costs > 0) & (costs <= budget)])
    out: list[tuple[float, list[float]]] = []
    for low, high in zip(values[:-1].tolist(), values[1:].tolist()):
        steps = int(np.ceil(np.log(high / low) / np.log(_RATIO)))
        if steps > 1:
            out.append((high / low, [low * (high / low) ** (k / steps) for k in range(1, steps)]))
    return [targets for _, targets in sorted(out, key=lambda jump: -jump[0])]


def bridge_gaps(
    done: list[tuple[list[int], float]],
    rows: np.ndarray | list[list[float]],
    cells: np.ndarray,
    weights: _Weights,
    budget: float,
    max_size: int | None,
    mixes: np.ndarray | None = None,
) -> list[tuple[list[int], float]]:
    """``done`` with the jumps in its costs bridged by pieces of fluid micro-batches of one bucket (``cells``: per row),
    or of one modality mix (``mixes``: per row) when its cells are each too small to.

    Pure; a window with no jump, no fluid bucket or too few of its micro-batches is returned as it is.
    A few passes: each bridges the widest jumps one bucket (or mix) can afford, and what it cuts from
    the rest of its samples may open a jump of its own.
    """
    for _ in range(_PASSES):
        bridged = _bridge(done, rows, cells, weights, budget, max_size, cells if mixes is None else mixes)
        if bridged is done:
            break
        done = bridged
    return done


def _bridge(
    done: list[tuple[list[int], float]],
    rows: np.ndarray | list[list[float]],
    cells: np.ndarray,
    weights: _Weights,
    budget: float,
    max_size: int | None,
    mixes: np.ndarray,
) -> list[tuple[list[int], float]]:
    """One pass of `bridge_gaps`."""
    if len(done) < 2 or not len(rows):
        return done
    costs = np.array([cost for _, cost in done])
    jumps = _jumps(costs, budget)
    if not jumps:
        return done
    table = np.asarray(rows, dtype=np.float64)  # no copy: the window's table
    own = _padded(np.ones(len(rows)), table, weights)
    flat, starts = _segments([m for m, _ in done])
    pure = _uniform(np.asarray(cells, dtype=np.int64)[flat], starts, _MIXED) != _MIXED  # one cell per micro-batch
    one_mix = _uniform(np.asarray(mixes, dtype=np.int64)[flat], starts, _MIXED) != _MIXED
    fluid = [i for i, (m, c) in enumerate(done) if len(m) >= _FLUID and c >= _FULL * budget and pure[i]]
    groups: dict[tuple[int, int], list[int]] = {}  # (0, bucket) or, spanning a mix's cells, (1, mix)
    for i in fluid:
        groups.setdefault((0, int(cells[done[i][0][0]])), []).append(i)
        if one_mix[i]:
            groups.setdefault((1, int(mixes[done[i][0][0]])), []).append(i)
    if not groups:
        return done
    most = max(_FEW, int(_SHARE * len(done)))
    grains: dict[tuple[int, ...], float] = {}

    def afforded(group: list[int]) -> list[float]:
        """Targets, widest jumps first, that ``group``'s micro-batches can pay for (at most `most`) and cut finely
        enough (its short samples, the tenth percentile, cost under `_GRAIN` of a target); of a jump it cannot pay
        for whole, the upper part (a later pass bridges the rest with another group)."""
        room, out = sum(done[i][1] for i in group) - _SPARE * budget, list[float]()
        grain = grains.get(tuple(group))
        if grain is None:
            grain = grains[tuple(group)] = float(np.quantile(own[np.concatenate([done[i][0] for i in group])], 0.1))
        # jumps it can close whole first: bridging only the top of one leaves a jump below all the same
        for targets in sorted(jumps, key=lambda targets: min(targets) * _GRAIN < grain):
            for target in sorted(targets, reverse=True):
                if target * _GRAIN < grain or target > room or len(out) >= most:
                    break
                room -= target
                out.append(target)
        return out

    # the bucket that bridges the most (cutting its micro-batches anew keeps every stream's cell), a whole mix
    # only where it bridges more (its samples cut in cell order); of their micro-batches, those of the most samples
    key = max(groups, key=lambda g: (len(afforded(groups[g])), -g[0], -min(groups[g])))
    sources = groups[key]
    targets = afforded(sources)
    if not targets:
        return done  # too few fluid micro-batches here to bridge with, or too coarse ones
    sources.sort(key=lambda i: (-len(done[i][0]), i))
    need = int(np.ceil(sum(targets) / budget / _FULL)) + _SPARE
    chosen = sources[:need]
    total = sum(done[i][1] for i in chosen)
    samples = sorted((s for i in chosen for s in done[i][0]), key=lambda s: (cells[s], own[s], s))
    pieces: list[tuple[list[int], float]] = []
    at = 0
    for target in sorted(targets):
        members: list[int] = []
        longest = np.zeros(table.shape[1])
        cost = 0.0
        while at < len(samples):
            top = np.maximum(longest, table[samples[at]])
            with_it = _scalar_padded(len(members) + 1, top.tolist(), weights)
            if members and (with_it > target or (max_size is not None and len(members) >= max_size)):
                break
            members.append(samples[at])
            longest, cost = top, with_it
            at += 1
        if members:
            pieces.append((members, cost))
    # what the rest will cost: its samples' own costs, padded as much as the sources were
    padding = total / max(float(own[samples].sum()), 1e-9)
    left = float(own[samples[at:]].sum()) * padding
    rest = None
    for parts in (int(np.ceil(left / budget)), int(np.ceil(left / budget)) + 1):
        rest = _even_cut(samples[at:], table, weights, parts, budget, max_size) if at < len(samples) else None
        if rest is not None:
            break
    if rest is None or min(c for _, c in rest) < _LIGHT * budget:
        return done
    kept = [batch for i, batch in enumerate(done) if i not in set(chosen)]
    return kept + pieces + rest
