"""The plan's micro-batches are pinned: a saved run resumes into the micro-batches it was dealing only while the
planner forms the same ones for the same (index, config). A change to what budget mode or packing forms (a faster
filler that rounds differently, a new leftover rule) fails here; if it is meant, bump the state format
(`STATE_FORMAT` in `loader/plan/_cursor.py`, so older states are refused in one line) and pin the new digests."""

from __future__ import annotations

import hashlib

import pytest
from test_plan import synthetic_lengths

from omnifeed.bucketing import BucketingConfig, CostModel
from omnifeed.loader.plan import Plan, PlanConfig, PlanCursor

# epoch 0 of 5,000 samples at world size 4: sha256 of every micro-batch's positions and cost, first 16 hex digits
PINNED = {
    "budget": ("c4ce02e0506f224d", {"budget": 6000.0, "overlong": "alone", "max_batch_size": 12}),
    "quadratic": ("9621c196e2896c1d", {"budget": 9000.0, "overlong": "alone", "cost": CostModel(quadratic=0.01)}),
    "packing": ("243b4fae5c731c92", {"mode": "packing", "budget": 4096.0, "overlong": "split"}),
}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_the_planner_forms_the_micro_batches_it_formed_when_states_were_saved(case: str) -> None:
    pinned, bucketing = PINNED[case]
    config = PlanConfig(seed=4, bucketing=BucketingConfig(**bucketing))
    plan = Plan(5000, config, index_fingerprint="golden", lengths=synthetic_lengths(5000))
    cursor, digest = PlanCursor(plan, world_size=4), hashlib.sha256()
    while not cursor.epoch_delivered(0):
        for mb in cursor.next_step().micro_batches:
            digest.update(mb.positions.tobytes())
            digest.update(repr(mb.cost).encode())
    assert digest.hexdigest()[:16] == pinned, f"{case}: the plan forms other micro-batches; see this module's doc"
