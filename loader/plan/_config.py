"""`PlanConfig`: what fixes the global micro-batch sequence (docs/config.md)."""

from __future__ import annotations

import json
from typing import Literal

import xxhash
from pydantic import Field, model_validator

from omnifeed.bucketing import BucketingConfig

from .._config import StrictModel
from ._mixture_config import MixtureConfig

# The budget-mode algorithm: a config fingerprint names the sequence it makes, so one state of an
# older algorithm never matches (2: issue 29, cells and windows from the data, leftovers evened).
BUDGET_ALGORITHM = 2


class PlanConfig(StrictModel):
    """What fixes the global micro-batch sequence (with the index fingerprint and the epoch)."""

    seed: int = Field(default=0, ge=0, lt=2**63, description="Shuffle seed.")
    batch_size: int = Field(default=8, ge=1, description="Samples per micro-batch.")
    shuffle: Literal["permutation", "shard_block", "none"] = Field(
        default="permutation",
        description="'permutation': keyed pseudo-random permutation of all samples; "
        "'shard_block': shuffled shard order, shuffled within windows of shards (sequential reads); "
        "'none': index order.",
    )
    shards_per_window: int = Field(default=4, ge=1, description="Shards per shuffle window in 'shard_block' mode.")
    window_size: int | None = Field(
        default=None,
        ge=1,
        description="Samples per window of the shuffled stream (not in 'shard_block' mode, where a window is "
        "shards_per_window shards): micro-batches are formed window by window, and resuming computes one window. "
        "Default: 64 micro-batches for fixed-size batches, 65536 samples with bucketing (it needs hundreds of "
        "micro-batches per window to fill them tightly).",
    )
    bucketing: BucketingConfig | None = Field(
        default=None, description="Length-bucketed, cost-budgeted micro-batches or packing instead of batch_size."
    )
    mixture: MixtureConfig | None = Field(
        default=None,
        description="Train on a weighted blend of indexes (sources, weights or repeats, filters, phases) instead of "
        "one index: docs/index-and-plan.md, Mixtures.",
    )
    drop_last: bool = Field(
        default=False,
        description="Drop each epoch's last, short micro-batch (its samples are reported, never silently lost); "
        "fixed-size batches only.",
    )

    @model_validator(mode="after")
    def _mixture_needs_a_permutation(self) -> PlanConfig:
        if self.mixture is not None and self.shuffle != "permutation":
            raise ValueError(
                f"a mixture interleaves its sources' own permutations: set shuffle: permutation, not {self.shuffle}"
            )
        return self

    @model_validator(mode="after")
    def _drop_last_needs_fixed_batches(self) -> PlanConfig:
        if self.drop_last and self.bucketing is not None:
            raise ValueError("drop_last applies to fixed-size batches; with bucketing no micro-batch is short")
        return self

    def fingerprint(self) -> str:
        """Stable hash of every setting that changes the micro-batch sequence."""
        values = self.model_dump()
        if self.bucketing is not None:  # the memory-feedback bounds steer budgets; the cursor records each
            values["bucketing"] = {
                k: v for k, v in values["bucketing"].items() if k not in ("min_budget", "max_budget", "target_headroom")
            }
            if self.bucketing.mode == "budget":
                values["budget_algorithm"] = BUDGET_ALGORITHM
        if self.mixture is not None:  # the sources' data is in the index fingerprint, not their paths
            values["mixture"] = self.mixture.plan_fingerprint_values()  # the schedule: in the cursor's state
        else:
            values.pop("mixture")  # the fingerprints of plans before mixtures stay as they were
        payload = json.dumps(values, sort_keys=True)
        return xxhash.xxh3_64_hexdigest(payload.encode())
