"""omnifeed.loader.plan: the keyed permutation, the plan, the cursor, plan reports and delivery records."""

from ._audit import (
    CoverageReport,
    delivery_record,
    delivery_records,
    open_audit_log,
    read_delivery_logs,
    verify_coverage,
)
from ._budget import alone_costs, budget_guidance, suggest_budget
from ._config import PlanConfig
from ._cursor import DealingStopped, PlanCursor, change_mixture, steps_left_in_epoch
from ._mixture import MixtureStream, mixture_stream, open_mixture
from ._mixture_audit import MixtureCoverageReport, SourceCoverage, verify_mixture
from ._mixture_config import MixtureConfig, MixturePhaseConfig, MixtureSource
from ._mixture_report import MixtureReport
from ._plan import MicroBatch, Plan
from ._planned import PlannedEpoch, PlannedEpochs, planned_epochs, write_planned_epochs
from ._report import PlanReport
from ._step import Step

__all__ = [
    "CoverageReport",
    "DealingStopped",
    "MicroBatch",
    "MixtureConfig",
    "MixtureCoverageReport",
    "MixturePhaseConfig",
    "MixtureReport",
    "MixtureSource",
    "MixtureStream",
    "Plan",
    "PlanConfig",
    "PlanCursor",
    "PlanReport",
    "PlannedEpoch",
    "PlannedEpochs",
    "SourceCoverage",
    "Step",
    "alone_costs",
    "budget_guidance",
    "change_mixture",
    "delivery_record",
    "delivery_records",
    "mixture_stream",
    "open_audit_log",
    "open_mixture",
    "planned_epochs",
    "read_delivery_logs",
    "steps_left_in_epoch",
    "suggest_budget",
    "verify_coverage",
    "verify_mixture",
    "write_planned_epochs",
]
