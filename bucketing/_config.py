"""`BucketingConfig`: how micro-batches are formed from lengths instead of a fixed count."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._cost import STREAMS, CostModel


class BucketingConfig(BaseModel):
    """Cost-budgeted, length-bucketed micro-batches (``mode='budget'``) or sequence packing (``'packing'``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["budget", "packing"] = Field(
        default="budget", description="Fill micro-batches to a cost budget, or pack sequences."
    )
    budget: float = Field(gt=0, description="Cost units per micro-batch ('budget'); tokens per pack ('packing').")
    cost: CostModel = Field(default_factory=CostModel, description="Stream lengths and weights.")
    num_buckets: int = Field(default=8, ge=1, description="Buckets per bucketing stream (estimated edges).")
    method: Literal["equal_cost", "quantile"] = Field(default="equal_cost", description="How edges are estimated.")
    edges: dict[str, list[float]] | None = Field(default=None, description="Explicit inclusive upper edges per stream.")
    bucket_streams: list[str] | None = Field(
        default=None,
        description="Streams whose lengths define buckets (default: every weighted stream the index has; a "
        "bucket is then a length range or 'absent' per stream, so modality mixes are never batched together).",
    )
    max_batch_size: int | None = Field(default=None, ge=1, description="Cap on samples per micro-batch.")
    overlong: Literal["reject", "alone", "split"] = Field(
        default="reject",
        description="A sample over the budget: 'reject' (error naming it), 'alone' (its own micro-batch, over "
        "budget, reported; budget mode), 'split' (cut into capacity-sized segments; packing mode).",
    )
    pack_stream: str = Field(default="text", description="The sequence stream packed in 'packing' mode.")
    lookahead: int = Field(
        default=256, ge=0, description="Samples a window may borrow from the next to fill its last micro-batch."
    )
    tier_width: float | None = Field(
        default=0.02,
        gt=0,
        le=1,
        description="Deal a window's micro-batches in cost tiers this wide (a ratio; shuffled within a tier), so "
        "that any W consecutive ones cost about the same; null: shuffle the whole window.",
    )
    carry: int = Field(
        default=256,
        ge=0,
        description="Budget mode: a window's light micro-batches (under 0.75 of the budget) go to the next window, "
        "at most this many samples (their ids are in the cursor state); the epoch's last window keeps its own. "
        "0: never carry.",
    )
    min_budget: float | None = Field(
        default=None, gt=0, description="Lower bound for memory feedback (default budget / 4)."
    )
    max_budget: float | None = Field(
        default=None, gt=0, description="Upper bound for memory feedback (default budget)."
    )
    target_headroom: float = Field(default=0.1, ge=0, lt=1, description="Memory headroom fraction feedback steers to.")

    @model_validator(mode="after")
    def _consistent(self) -> BucketingConfig:
        for stream in [*(self.bucket_streams or []), *(self.edges or {}), self.pack_stream]:
            if stream not in STREAMS:
                raise ValueError(f"unknown stream {stream!r}; streams are {', '.join(STREAMS)}")
        if self.bucket_streams is not None and not self.bucket_streams:
            raise ValueError("bucket_streams names at least one stream (or leave it unset)")
        if self.overlong == "split" and self.mode != "packing":
            raise ValueError("overlong='split' applies to packing mode only; use 'reject' or 'alone'")
        if self.overlong == "alone" and self.mode != "budget":
            raise ValueError("overlong='alone' applies to budget mode only; use 'reject' or 'split'")
        if self.bounds[0] > self.budget or self.bounds[1] < self.budget:
            raise ValueError(f"budget {self.budget} outside its feedback bounds {self.bounds}")
        return self

    @property
    def bounds(self) -> tuple[float, float]:
        """(min, max) budget that memory feedback may choose."""
        return (self.min_budget or self.budget / 4, self.max_budget or self.budget)
