"""Buckets per modality mix: every weighted stream of a micro-batch tight, not only the costliest.

A *mix* is the set of weighted streams a sample has (text only; image + caption; video +
caption + speech; ...). Samples of different mixes never share a bucket (no rows of pure
padding). Within a mix, the *primary* stream is the one that costs the most in total; the
bucket's fill sorts by cost, which the primary dominates, so the primary is tight by sorting.
The other streams of the mix (captions beside images, transcripts beside speech) are
*secondary*: they get length cells of their own, with edges estimated from that mix's samples
alone — not from all text, where documents would put every caption in the first cell.

How many cells is chosen from the data, per mix: cells make the secondary tight but split the
mix's micro-batches between them, and a cell of few micro-batches pads its primary (padding of
a sorted fill falls as ``spread / micro-batches``). So each candidate count is tried on the
mix's probe samples at the density a window holds (`fill_slots`), and the counts making the
index's worst stream pad least win (mixes share streams — captions and documents are both
text — so they are chosen together, by coordinate descent); among layouts under the target in
every stream, the one wasting the least cost; fewer cells on a near tie. A secondary that follows its primary
(transcripts and speech) needs few cells; an independent one (captions of photos) more, the
more micro-batches the window gives the mix. The estimate per stream is kept in the layout:
it says which streams a window of this size cannot make tight (`MixLayout.estimate`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ._buckets import estimate_boundaries
from ._cost import CostModel, sample_costs
from ._estimate import fill_slots

_MIX_BITS = 20  # a bucket id is (mix mask << _MIX_BITS) + the cell of its secondaries
_CELLS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # candidate cells per secondary stream
_GRID_CELLS = (1, 2, 3, 4, 6, 8, 12, 16)  # per stream, for a mix with two secondaries
_NEAR_TIE = 1.03  # a count within 3 % of the best (relative padding) counts as a tie: fewer cells win
_MIN_PER_BATCH = 8  # a probe subsample keeps at least this many samples per estimated micro-batch
_SUBSAMPLE = 16384  # most samples of one mix the estimate is computed on

_Candidate = tuple[int, dict[str, np.ndarray], dict[str, tuple[float, float]]]  # cells, edges, estimated (used, slots)


@dataclass(frozen=True)
class MixLayout:
    """The weighted streams; per mix (a presence mask over them) its primary and its secondaries' edges.

    ``estimate`` is the padding per stream a window of ``window`` samples is expected to leave
    (the probe filled at that density); ``batches`` the micro-batches per window of each mix.
    """

    streams: tuple[str, ...]
    primary: dict[int, str] = field(default_factory=dict)
    edges: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    window: int = 0
    estimate: dict[str, float] = field(default_factory=dict)
    batches: dict[int, float] = field(default_factory=dict)


def mix_masks(lengths: Mapping[str, np.ndarray], streams: tuple[str, ...]) -> np.ndarray:
    """Per sample, the bit mask of the ``streams`` it has (bit ``i`` for ``streams[i]``; int64)."""
    size = len(next(iter(lengths.values()))) if lengths else 0
    mask = np.zeros(size, dtype=np.int64)
    for bit, stream in enumerate(streams):
        mask |= (np.asarray(lengths[stream]) > 0).astype(np.int64) << bit
    return mask


def _cells_of(lengths: Mapping[str, np.ndarray], edges: Mapping[str, np.ndarray]) -> np.ndarray:
    """The secondaries' cell per sample, row-major over ``edges``."""
    size = len(next(iter(lengths.values()))) if lengths else 0
    cell = np.zeros(size, dtype=np.int64)
    for stream, bounds in edges.items():
        cell = cell * (bounds.size + 1) + np.searchsorted(bounds, np.asarray(lengths[stream]), side="left")
    return cell


def _at_window_density(
    members: np.ndarray, total: int, window: int, mean_cost: float, budget: float
) -> tuple[np.ndarray, float]:
    """The probe members to estimate on and the budget to fill them to, so they make a window's micro-batches.

    A window holds ``members / total × window`` samples of the mix; more probe samples than that
    are thinned evenly (down to `_SUBSAMPLE`, keeping `_MIN_PER_BATCH` per micro-batch), and the
    budget is scaled by the ratio, so the estimate fills as many micro-batches as a window.
    """
    in_window = max(members.size / max(total, 1) * window, 1.0)
    per_batch = max(budget / max(mean_cost, 1e-9), 1.0)
    keep = int(min(members.size, max(min(in_window, _SUBSAMPLE), _MIN_PER_BATCH * in_window / per_batch)))
    keep = max(keep, 1)
    chosen = members[np.unique(np.linspace(0, members.size - 1, keep).round().astype(np.int64))]
    return chosen, budget * chosen.size / in_window


def _candidates(
    lengths: Mapping[str, np.ndarray],
    chosen: np.ndarray,
    secondaries: Sequence[str],
    budget: float,
    model: CostModel,
    max_cells: int,
) -> list[_Candidate]:
    """Per candidate cell count: (cells, the secondaries' edges, the estimated fill's slots of ``chosen``)."""
    sub = {s: np.asarray(v)[chosen] for s, v in lengths.items()}
    options = _CELLS if len(secondaries) == 1 else _GRID_CELLS
    counts = [c for c in options if c <= max_cells] or [1]
    out: list[_Candidate] = []
    for combo in itertools.product(counts, repeat=len(secondaries)):
        edges = {s: estimate_boundaries(sub[s], c, "quantile") for s, c in zip(secondaries, combo)}
        cells = int(np.prod([e.size + 1 for e in edges.values()]))
        if any(all(np.array_equal(edges[s], seen[s]) for s in edges) for _, seen, _ in out):
            continue  # fewer distinct lengths than cells asked for: the same edges again
        out.append((cells, edges, fill_slots(sub, _cells_of(sub, edges), budget, model)))
    return out


def _score(
    used: Mapping[str, float], slots: Mapping[str, float], weights: Mapping[str, float], target: float
) -> tuple[float, float]:
    """(the worst stream's padding, not below ``target``; the padding's cost): lower is better."""
    pads = [1.0 - used[s] / slots[s] for s in slots if slots[s] > 0]
    waste = sum(weights[s] * (slots[s] - used[s]) for s in slots)
    return max(max(pads, default=0.0), target), waste


def _choose(
    options: dict[int, list[_Candidate]],
    fixed: dict[str, list[float]],
    weights: Mapping[str, float],
    target: float,
) -> dict[int, int]:
    """Per mix, the candidate that makes the index's worst stream pad least (then waste least cost).

    Coordinate descent over the mixes, a few rounds: mixes share streams (captions and documents
    are both text), so each is chosen with the others' current choice counted.
    """
    choice = {mask: 0 for mask in options}

    def totals(skip: int | None) -> tuple[dict[str, float], dict[str, float]]:
        used = {s: u for s, (u, _) in fixed.items()}
        slots = {s: t for s, (_, t) in fixed.items()}
        for mask, k in choice.items():
            if mask == skip:
                continue
            for s, (u, t) in options[mask][k][2].items():
                used[s], slots[s] = used.get(s, 0.0) + u, slots.get(s, 0.0) + t
        return used, slots

    for _ in range(3):
        changed = False
        for mask, candidates in options.items():
            used, slots = totals(mask)
            best, best_score = choice[mask], None
            for k, (_, _, mix_slots) in enumerate(candidates):
                u, t = dict(used), dict(slots)
                for s, (a, b) in mix_slots.items():
                    u[s], t[s] = u.get(s, 0.0) + a, t.get(s, 0.0) + b
                score = _score(u, t, weights, target)
                if (
                    best_score is None
                    or score[0] * _NEAR_TIE < best_score[0]
                    or (score[0] <= best_score[0] * _NEAR_TIE and score[1] < best_score[1] / _NEAR_TIE)
                ):
                    best, best_score = k, score
            changed |= best != choice[mask]
            choice[mask] = best
        if not changed:
            break
    return choice


def estimate_mix_layout(
    lengths: Mapping[str, np.ndarray],
    model: CostModel,
    budget: float,
    window: int,
    num_buckets: int,
    *,
    max_cells: int | None = None,
    target: float = 0.027,
) -> MixLayout:
    """The layout estimated from an even sample of the index (``lengths``), for windows of ``window`` samples.

    Secondary cells per stream: chosen from the data (module docstring), at most ``max_cells``
    (default: ``max(num_buckets, 64)``); below ``target`` padding in every stream, the layout
    that wastes the least cost. Raises ValueError for a budget, window or ``num_buckets`` that is
    not positive.
    """
    if budget <= 0 or window < 1 or num_buckets < 1:
        raise ValueError(f"budget, window and num_buckets must be positive, got {budget}, {window}, {num_buckets}")
    cap = max_cells if max_cells is not None else max(num_buckets, _CELLS[-1])
    streams = tuple(s for s in lengths if model.weight(s) > 0)
    weighted = {s: np.asarray(lengths[s]) for s in streams}
    masks = mix_masks(weighted, streams)
    total = len(masks)
    costs = sample_costs(weighted, model)
    primary: dict[int, str] = {}
    batches: dict[int, float] = {}
    fixed: dict[str, list[float]] = {}  # slots of the single-stream mixes
    options: dict[int, list[_Candidate]] = {}
    for mask in np.unique(masks).tolist():
        present = [s for bit, s in enumerate(streams) if mask >> bit & 1]
        if not present:
            continue
        members = np.flatnonzero(masks == mask)
        mean = float(costs[members].mean())
        batches[mask] = members.size / max(total, 1) * window * mean / budget
        chosen, scaled = _at_window_density(members, total, window, mean, budget)
        weight = members.size / chosen.size  # the mix's share of the probe
        if len(present) < 2:
            sub = {s: weighted[s][chosen] for s in present}
            for s, (u, t) in fill_slots(sub, np.zeros(chosen.size, dtype=np.int64), scaled, model).items():
                fixed.setdefault(s, [0.0, 0.0])
                fixed[s][0] += u * weight
                fixed[s][1] += t * weight
            continue
        parts = {s: float(sample_costs({s: weighted[s][members]}, model).sum()) for s in present}
        primary[mask] = max(present, key=lambda s: (parts[s], -present.index(s)))
        secondaries = [s for s in present if s != primary[mask]]
        options[mask] = [
            (cells, edges, {s: (u * weight, t * weight) for s, (u, t) in slots.items()})
            for cells, edges, slots in _candidates(weighted, chosen, secondaries, scaled, model, cap)
        ]
    choice = _choose(options, fixed, {s: model.weight(s) for s in streams}, target)
    edges = {mask: options[mask][k][1] for mask, k in choice.items()}
    used = {s: u for s, (u, _) in fixed.items()}
    slots = {s: t for s, (_, t) in fixed.items()}
    for mask, k in choice.items():
        for s, (u, t) in options[mask][k][2].items():
            used[s], slots[s] = used.get(s, 0.0) + u, slots.get(s, 0.0) + t
    estimate = {s: round(1.0 - used[s] / slots[s], 6) for s in sorted(slots) if slots[s] > 0}
    return MixLayout(streams, primary, edges, window, estimate, batches)


def mix_buckets(lengths: Mapping[str, np.ndarray], layout: MixLayout) -> np.ndarray:
    """Bucket id per sample (int64): its mix, and for a mix with secondaries the cell of their lengths."""
    masks = mix_masks(lengths, layout.streams)
    cells = np.zeros(len(masks), dtype=np.int64)
    for mask, stream_edges in layout.edges.items():
        members = masks == mask
        if members.any():
            cells[members] = _cells_of({s: np.asarray(lengths[s])[members] for s in stream_edges}, stream_edges)
    return (masks << _MIX_BITS) + cells


def choose_window_layout(
    lengths: Mapping[str, np.ndarray],
    model: CostModel,
    budget: float,
    windows: Sequence[int],
    num_buckets: int,
    *,
    target: float = 0.027,
) -> MixLayout:
    """The layout for the smallest of ``windows`` (ascending sample counts) whose estimate is under ``target`` in every
    stream.

    When none is, the layout of the window whose worst stream is estimated lowest (ties: the
    smaller window). Raises ValueError for no window.
    """
    if not windows:
        raise ValueError("choose_window_layout needs at least one window size")
    best: MixLayout | None = None
    for window in windows:
        layout = estimate_mix_layout(lengths, model, budget, window, num_buckets, target=target)
        worst = max(layout.estimate.values(), default=0.0)
        if worst <= target:
            return layout
        if best is None or worst * _NEAR_TIE < max(best.estimate.values(), default=0.0):
            best = layout
    assert best is not None
    return best
