"""Which mechanism keeps a plan's padding or balance over its target: the ``limits`` of `omnifeed plan --stats`.

Targets: padding at most 3 % in every stream, and every step but the epoch's final one at most
1.15 × its mean (max/mean of the costs its ranks receive). Each limit is one line naming the
mechanism and what would lift it:

- ``epoch too small`` / ``window too small for stream S``: the modality mixes holding S fill too
  few micro-batches per window for a sorted fill to pad under the target (the layout's estimate
  says so before planning);
- ``leftovers in stream S``: the estimate holds but the plan pads more (partly filled
  micro-batches);
- ``bucket edges``: explicit ``edges``/``bucket_streams`` (no estimate to compare with);
- ``overlong samples``: the worst step deals a sample alone over the budget (``overlong:
  alone``) beside micro-batches that cannot match it;
- ``budget too small for whole samples``: a micro-batch of one or a few samples costs far under
  the budget and one more does not fit: costs come in steps of a whole sample;
- ``light leftovers`` / ``cost tiers``: what remains.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from omnifeed.bucketing import MixLayout, sample_costs

from ._bucket_plan import PADDING_TARGET
from ._plan import MicroBatch, Plan

PADDING_LIMIT = 0.03  # target: padding per stream
BALANCE_LIMIT = 1.15  # target: max/mean of a step, the epoch's final step apart
_LIGHT = 0.75


def _mix_name(mask: int, layout: MixLayout) -> str:
    return "+".join(s for bit, s in enumerate(layout.streams) if mask >> bit & 1)


def padding_limits(plan: Plan, padding: Mapping[str, float]) -> list[str]:
    """One line per stream padded over the target, naming why."""
    out = []
    bucketing = plan.bucketing
    for stream, value in sorted(padding.items()):
        if value <= PADDING_LIMIT or bucketing is None or bucketing.mode != "budget":
            continue
        layout = plan.layout
        if layout is None:
            out.append(
                f"bucket edges: stream {stream} pads {value:.1%} with the configured edges/bucket_streams; "
                "leave both unset to have cells and the window chosen from the data"
            )
            continue
        estimate = layout.estimate.get(stream, 0.0)
        if estimate <= PADDING_TARGET:
            out.append(
                f"leftovers in stream {stream}: it pads {value:.1%} where a sorted fill of each modality mix pads "
                f"{estimate:.1%}: partly filled micro-batches"
            )
            continue
        bit = layout.streams.index(stream) if stream in layout.streams else -1
        mixes = {mask: n for mask, n in layout.batches.items() if bit >= 0 and mask >> bit & 1}
        described = ", ".join(
            f"{_mix_name(m, layout)} {n:,.0f}" for m, n in sorted(mixes.items(), key=lambda kv: kv[1])
        )
        whole = plan.window_size >= plan.num_samples
        what = "epoch too small" if whole else "window too small"
        more = (
            "more samples or a smaller budget"
            if whole
            else "a larger window_size (up to the epoch) or a smaller budget"
        )
        out.append(
            f"{what} for stream {stream}: its modality mixes fill {described} micro-batches per window of "
            f"{min(plan.window_size, plan.num_samples):,} samples, too few for {PADDING_LIMIT:.0%} padding "
            f"(estimated {estimate:.1%}); {more} make more"
        )
    return out


def balance_limits(plan: Plan, worst: float, step: Sequence[MicroBatch]) -> list[str]:
    """One line when the worst step (the epoch's final one apart) is over the target, naming why."""
    budget = plan.budget
    if worst <= BALANCE_LIMIT or not step:
        return []
    if budget is None:
        return [f"fixed-size batches: the worst step costs {worst:.2f} × its mean; set a cost budget (bucketing)"]
    costs = np.array([mb.cost for mb in step]) / budget
    shown = ", ".join(f"{c:.2f}" for c in costs)
    if costs.max() > 1.0 and any(mb.positions.size == 1 and mb.cost > budget for mb in step):
        return [
            f"overlong samples: the worst step ({worst:.2f} × its mean) deals micro-batches of {shown} budgets, "
            "samples alone over the budget beside ones that cannot match them; a budget holding them "
            "(budget_guidance.budget_holding_100) or fewer of them evens it"
        ]
    lightest = step[int(np.argmin(costs))]
    if costs.min() < _LIGHT and plan.bucketing is not None:
        alone = sample_costs(plan.stream_lengths(lightest.positions), plan.bucketing.cost)
        if lightest.cost * (lightest.positions.size + 1) / lightest.positions.size > budget or alone.min() > budget / 6:
            return [
                f"budget too small for whole samples: the worst step ({worst:.2f} × its mean) deals {shown} budgets; "
                f"its lightest holds {lightest.positions.size} sample(s) of {alone.min() / budget:.2f} budgets or more "
                "and one more does not fit: costs come in steps of a whole sample; a budget where they pair evens it"
            ]
        return [f"light leftovers: the worst step ({worst:.2f} × its mean) deals {shown} budgets"]
    return [f"cost tiers: the worst step ({worst:.2f} × its mean) straddles costs {shown} budgets"]
