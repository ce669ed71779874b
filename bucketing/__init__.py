"""omnifeed.bucketing: per-stream cost, bucket edges, packing and batch metrics (pure, no I/O)."""

from ._assemble import Assembled, OverBudgetError, assemble_budget, assemble_fixed, light_to_carry
from ._buckets import assign_buckets, choose_bucket_streams, estimate_boundaries, num_cells
from ._config import BucketingConfig
from ._cost import INDEX_COLUMNS, STREAMS, CostModel, padded_cost, sample_costs, stream_lengths
from ._deal import cost_tiers, even_order
from ._estimate import fill_slots
from ._layout import MixLayout, choose_window_layout, estimate_mix_layout, mix_buckets, mix_masks
from ._metrics import balance, costliest, pack_padding_fraction, padding_fraction
from ._pack import OverlongSampleError, Pack, Segment, pack_window

__all__ = [
    "Assembled",
    "BucketingConfig",
    "CostModel",
    "INDEX_COLUMNS",
    "MixLayout",
    "OverBudgetError",
    "OverlongSampleError",
    "Pack",
    "STREAMS",
    "Segment",
    "assemble_budget",
    "assemble_fixed",
    "assign_buckets",
    "balance",
    "choose_bucket_streams",
    "choose_window_layout",
    "cost_tiers",
    "costliest",
    "estimate_boundaries",
    "estimate_mix_layout",
    "even_order",
    "fill_slots",
    "light_to_carry",
    "mix_buckets",
    "mix_masks",
    "num_cells",
    "pack_padding_fraction",
    "pack_window",
    "padded_cost",
    "padding_fraction",
    "sample_costs",
    "stream_lengths",
]
