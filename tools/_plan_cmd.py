"""`omnifeed plan`: the flags onto `PlanConfig`, the plan dealt step by step as JSON lines, ``--stats``, ``--worst``,
``--suggest-budget`` and state files; over one index (INDEX_DIR) or the mixture a ``--config`` names."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omnifeed.loader import Plan, PlanConfig, PlanCursor, SampleIndex, Step, delivery_records, validated
from omnifeed.loader.index import MixtureIndex
from omnifeed.loader.plan import (
    MixtureConfig,
    MixtureReport,
    PlanReport,
    budget_guidance,
    open_mixture,
    suggest_budget,
    write_planned_epochs,
)

from ._index_commands import _flags, _section

_STATE_FILE_KEYS = ("plan", "state")


def _plan_section(args: argparse.Namespace) -> dict[str, Any]:
    """The ``plan`` section of ``--config``, a mixture's paths (its indexes, its ``plans``) made absolute beside the
    file."""
    section = _section(args.config, "plan")
    mixture = section.get("mixture")
    if not isinstance(mixture, dict):
        return section
    folder = Path(args.config).resolve().parent if args.config else Path()
    sources = mixture.get("sources")
    holders = [(s, "index") for s in sources.values() if isinstance(s, dict)] if isinstance(sources, dict) else []
    for holder, key in [*holders, (mixture, "plans")]:
        path = holder.get(key)
        if isinstance(path, str) and "://" not in path:
            expanded = Path(path).expanduser()
            holder[key] = str(expanded if expanded.is_absolute() else folder / expanded)
    return section


def _plan_index(args: argparse.Namespace, saved: dict[str, Any] | None) -> SampleIndex | MixtureIndex:
    """INDEX_DIR opened, or the mixture the plan names (``--config``'s plan section, else ``--resume``'s state)."""
    mixture = (dict(saved or {}) | _plan_section(args)).get("mixture")
    if mixture is None:
        if args.index is None:
            args.parser.error("give INDEX_DIR, or a --config whose plan section has a mixture (it names the indexes)")
        return SampleIndex(args.index)
    where = args.config if "mixture" in _section(args.config, "plan") else args.resume
    if args.index is not None:
        raise ValueError(f"{where} has a plan.mixture, which names its own indexes: drop INDEX_DIR {args.index}")
    return open_mixture(validated(MixtureConfig, mixture, source=where, section=("plan", "mixture")))


def _plan_config(args: argparse.Namespace, saved: dict[str, Any] | None) -> PlanConfig:
    values = dict(saved or {}) | _plan_section(args)
    flags = _flags(args, ("seed", "batch_size", "shuffle", "shards_per_window", "drop_last", "window_size"))
    for flag in flags:
        values[flag] = getattr(args, flag)
    if args.budget is not None:
        bucketing = dict(values.get("bucketing") or {}) | {"budget": args.budget}
        values["bucketing"] = (
            bucketing
            | ({"mode": "packing"} if args.packing else {})
            | ({"overlong": args.overlong} if args.overlong else {})
        )
        flags |= {"bucketing.budget": "--budget"} | ({"bucketing.overlong": "--overlong"} if args.overlong else {})
    elif args.packing:
        args.parser.error("--packing needs --budget (tokens per pack)")
    return validated(PlanConfig, values, source=args.config, section=("plan",), flags=flags)


def run_plan(args: argparse.Namespace) -> int:
    """`omnifeed plan`: the plan's records (JSON lines), or its ``--stats`` / ``--worst`` / ``--suggest-budget``."""
    saved = _read_state_file(args.resume) if args.resume else None
    index = _plan_index(args, saved["plan"] if saved else None)
    if args.suggest_budget is not None:
        return _suggest(args, index, saved)
    plan = Plan.from_index(index, _plan_config(args, saved["plan"] if saved else None))
    if args.write_epochs is not None:
        return _write_epochs(args, plan, saved["state"] if saved else None)
    if args.world_size is None:
        args.parser.error("give --world-size: the data-parallel ranks sharing each step")
    if plan.dropped_per_epoch:
        logging.warning("drop_last: %d samples of every epoch are not delivered", plan.dropped_per_epoch)
    cursor = PlanCursor(
        plan, world_size=args.world_size, grad_accum=args.grad_accum, epoch=0 if saved else (args.epoch or 0)
    )
    if saved:
        cursor.load_state_dict(saved["state"], allow_mixture_change=args.allow_mixture_change)
    target = cursor.epoch if args.epoch is None else args.epoch
    out = sys.stdout
    report = PlanReport(plan, worst=args.worst or 0) if args.stats or args.worst else None
    sources = MixtureReport(plan, index, target) if args.stats and isinstance(index, MixtureIndex) else None
    for step in _steps(cursor, target, args.steps):
        if report is None:
            for record in delivery_records(step, index):
                out.write(json.dumps(record) + "\n")
        else:
            report.add(step)
        if sources is not None:
            sources.add(step)
    if report is not None and args.stats:
        stats = _stats(report, index, plan, args)
        out.write(json.dumps(stats if sources is None else {**stats, "sources": sources.stats()}) + "\n")
    if report is not None and args.worst:
        for row in report.costliest():
            row["keys"] = index.keys(row.pop("positions"))
            out.write(json.dumps(row) + "\n")
    out.flush()
    if args.save_state:
        state = {"plan": plan.config.model_dump(), "state": cursor.state_dict()}
        Path(args.save_state).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    return 0


def _write_epochs(args: argparse.Namespace, plan: Plan, state: dict[str, Any] | None) -> int:
    """`--write-epochs N`: plan N epochs once and write them under the index (a mixture: into its ``plans``
    folder); one JSON line per epoch. With ``--resume``, from the state's schedule (a mixture changed since), from
    its next whole epoch on."""
    if args.write_epochs < 1:
        raise ValueError(f"--write-epochs takes a number of epochs, 1 or more; got {args.write_epochs}")
    first = args.epoch or 0
    if state is not None:
        cursor = PlanCursor(plan, world_size=int(state["world_size"]), grad_accum=int(state["grad_accum"]))
        cursor.load_state_dict(state, allow_mixture_change=args.allow_mixture_change)
        whole = cursor.epoch + (1 if cursor.micro_batch else 0)  # the state's epoch is written whole or not at all
        if args.epoch is not None and args.epoch < whole:
            raise ValueError(f"--resume's state is within epoch {cursor.epoch}: write from --epoch {whole} on")
        first = whole if args.epoch is None else args.epoch

    def written(epoch: int, micro_batches: int) -> None:
        sys.stdout.write(json.dumps({"epoch": epoch, "micro_batches": micro_batches}) + "\n")
        sys.stdout.flush()

    root = write_planned_epochs(plan, None, range(first, first + args.write_epochs), written)
    logging.info("planned epochs written to %s", root)
    return 0


def _suggest(args: argparse.Namespace, index: SampleIndex | MixtureIndex, saved: dict[str, Any] | None) -> int:
    """`--suggest-budget N`: print the budget whose micro-batches hold N samples on average."""
    if args.packing:
        raise ValueError("--suggest-budget finds a cost budget for length-bucketed micro-batches; drop --packing")
    if args.budget is None:
        args.budget = 1.0  # a placeholder: the search replaces it; the cost model comes from --config
    plan = Plan.from_index(index, _plan_config(args, saved["plan"] if saved else None))
    if plan.bucketing is None or plan.bucketing.mode != "budget":
        raise ValueError("--suggest-budget needs budget mode: set plan.bucketing.mode to budget in --config")
    sys.stdout.write(json.dumps(suggest_budget(plan, args.suggest_budget)) + "\n")
    return 0


def _steps(cursor: PlanCursor, epoch: int, steps: int | None) -> Iterator[Step]:
    """``steps`` steps, or (without a count) steps until ``epoch`` is fully delivered."""
    dealt = 0
    while (not cursor.epoch_delivered(epoch)) if steps is None else dealt < steps:
        yield cursor.next_step()
        dealt += 1


def _stats(
    report: PlanReport, index: SampleIndex | MixtureIndex, plan: Plan, args: argparse.Namespace
) -> dict[str, Any]:
    """The plan's figures beside those of fixed-size batches of ``--batch-size`` over the same epoch."""
    stats = report.stats()
    if plan.bucketing is not None:
        naive_config = plan.config.model_copy(update={"bucketing": None})
        naive_plan = Plan.from_index(index, naive_config)
        naive = PlanReport(naive_plan, cost=plan.bucketing.cost)
        naive_cursor = PlanCursor(
            naive_plan, world_size=args.world_size, grad_accum=args.grad_accum, epoch=_report_epoch(args)
        )
        for step in _steps(naive_cursor, _report_epoch(args), args.steps):
            naive.add(step)
        stats["fixed_batch_size"] = {"batch_size": naive_config.batch_size, **naive.stats()}
    if plan.bucketing is not None and plan.bucketing.mode == "budget":
        stats["budget_guidance"] = _guidance(plan, args)
    return stats


def _guidance(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    """Samples over the budget and, when there are any, what the budgets holding 99 % / 100 % of them alone give."""
    guidance = budget_guidance(plan)
    if not guidance["samples_over_budget"]:
        return guidance
    assert plan.bucketing is not None
    for share in ("99", "100"):
        budget = max(guidance[f"budget_holding_{share}"], 1.0)
        bucketing = plan.bucketing.model_copy(
            update={"budget": budget, "overlong": "alone", "min_budget": None, "max_budget": None}
        )
        other = plan.with_config(plan.config.model_copy(update={"bucketing": bucketing}))
        report = PlanReport(other)
        cursor = PlanCursor(other, world_size=args.world_size, grad_accum=args.grad_accum, epoch=_report_epoch(args))
        for step in _steps(cursor, _report_epoch(args), args.steps):
            report.add(step)
        figures = report.stats()
        guidance[f"at_budget_holding_{share}"] = {
            "budget": budget,
            "samples_per_micro_batch": round(figures["samples"] / max(figures["micro_batches"], 1), 3),
            "padding_fraction": figures["padding_fraction"],
            "balance_max_over_mean": figures["balance_max_over_mean"],
            "balance_worst_before_final_step": figures["balance_worst_before_final_step"],
            "limits": figures["limits"],
        }
    return guidance


def _report_epoch(args: argparse.Namespace) -> int:
    """The epoch a report covers: ``--epoch``, else 0."""
    return args.epoch or 0


def _read_state_file(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: not a JSON state file ({exc})") from exc
    if not isinstance(data, dict) or set(data) != set(_STATE_FILE_KEYS):
        raise ValueError(f"{path}: not a state file written by `omnifeed plan --save-state`")
    return data
