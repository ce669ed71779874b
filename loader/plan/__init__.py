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
from ._cursor import DealingStopped, PlanCursor, Step, steps_left_in_epoch
from ._plan import MicroBatch, Plan
from ._report import PlanReport

__all__ = [
    "CoverageReport",
    "DealingStopped",
    "MicroBatch",
    "Plan",
    "PlanConfig",
    "PlanCursor",
    "PlanReport",
    "Step",
    "alone_costs",
    "budget_guidance",
    "delivery_record",
    "delivery_records",
    "open_audit_log",
    "read_delivery_logs",
    "steps_left_in_epoch",
    "suggest_budget",
    "verify_coverage",
]
