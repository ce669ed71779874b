"""`TopologyHints`: what a change of data-parallel size means for the global batch and the learning rate.

The trainer decides; nothing here is applied behind its back. `scale_learning_rate` is the
small helper for the usual decision.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

LrRule = Literal["linear", "sqrt", "none"]


@dataclass(frozen=True)
class TopologyHints:
    """A resize's consequences: new world, global batch, the accumulation that keeps it, the LR scale."""

    world_size: int  # data-parallel size after the change
    previous_world_size: int
    grad_accum: int  # accumulation micro-steps per step after the change (as asked)
    previous_grad_accum: int
    topology_version: int
    global_batch_samples: int | None  # samples per step after the change (None: cost-budget batches vary)
    global_batch_cost: float | None  # cost units (e.g. tokens) per step after the change; None for fixed-size batches
    keep_global_batch_grad_accum: (
        int | None
    )  # accumulation that keeps the previous global batch (None: not a whole number)
    lr_rule: LrRule
    lr_scale: float  # multiply the learning rate by this for the new global batch under ``lr_rule``

    def to_json(self) -> dict[str, Any]:
        """The hints as a JSON-ready dict."""
        return asdict(self)


def topology_hints(
    *,
    world_size: int,
    previous_world_size: int,
    grad_accum: int,
    previous_grad_accum: int,
    topology_version: int,
    micro_batch_samples: int | None,
    micro_batch_cost: float | None,
    lr_rule: LrRule = "linear",
) -> TopologyHints:
    """The hints of going from ``previous_world_size × previous_grad_accum`` to ``world_size × grad_accum``."""
    if lr_rule not in ("linear", "sqrt", "none"):
        raise ValueError(f"lr_rule must be 'linear', 'sqrt' or 'none', got {lr_rule!r}")
    before, after = previous_world_size * previous_grad_accum, world_size * grad_accum
    ratio = after / before
    scale = ratio if lr_rule == "linear" else math.sqrt(ratio) if lr_rule == "sqrt" else 1.0
    keep = before // world_size if before % world_size == 0 else None
    return TopologyHints(
        world_size=world_size,
        previous_world_size=previous_world_size,
        grad_accum=grad_accum,
        previous_grad_accum=previous_grad_accum,
        topology_version=topology_version,
        global_batch_samples=None if micro_batch_samples is None else after * micro_batch_samples,
        global_batch_cost=None if micro_batch_cost is None else after * micro_batch_cost,
        keep_global_batch_grad_accum=keep,
        lr_rule=lr_rule,
        lr_scale=scale,
    )


def scale_learning_rate(optimizer: Any, scale: float) -> None:
    """Multiply the learning rate of every param group of ``optimizer`` by ``scale`` (and ``initial_lr`` if set)."""
    if not scale > 0:
        raise ValueError(f"a learning-rate scale must be positive, got {scale}")
    for group in optimizer.param_groups:
        group["lr"] *= scale
        if "initial_lr" in group:  # LR schedulers derive from it
            group["initial_lr"] *= scale
