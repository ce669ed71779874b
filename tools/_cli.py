"""The `omnifeed` command line: demo, index, plan, verify.

Each command maps its flags one-to-one onto the typed configs of ``omnifeed.loader``.
Exit status: 0 on success, 1 with a one-line reason on a handled error, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omnifeed.loader import (
    IndexConfig,
    OmnifeedError,
    Plan,
    PlanConfig,
    PlanCursor,
    SampleIndex,
    build_index,
    delivery_records,
    read_delivery_logs,
    verify_coverage,
)
from omnifeed.loader._config import load_yaml
from omnifeed.loader._cursor import Step
from omnifeed.loader._plan_report import PlanReport
from omnifeed.loader._index_build import default_workers

__version__ = "0.1.0"
_STATE_FILE_KEYS = ("plan", "state")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `omnifeed` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if not args.verbose else logging.INFO, format="omnifeed: %(message)s")
    try:
        return int(args.run(args) or 0)
    except (OmnifeedError, OSError, ValueError) as exc:
        print(f"omnifeed: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("omnifeed: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnifeed", description="Data-pipeline-first loader for multimodal training.")
    parser.add_argument("--version", action="version", version=f"omnifeed {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="build the built-in dataset, index it, plan through a resize, verify")
    demo.add_argument("--out", default="demo-output", help="working directory (recreated)")
    demo.add_argument("--samples", type=int, default=240, help="samples in the generated dataset")
    demo.set_defaults(run=_run_demo)

    index = sub.add_parser("index", help="scan sources into a hash-partitioned sample index")
    index.add_argument("sources", nargs="+", metavar="SOURCE", help="tar shards, Parquet files or folders (fsspec URLs, globs, {a..b})")
    index.add_argument("--out", required=True, help="index directory to write")
    index.add_argument("--config", help="YAML file; its 'index' section is an IndexConfig")
    index.add_argument("--partitions", type=int, help="Parquet partitions (default 16)")
    index.add_argument("--workers", type=int, help=f"scan processes (default {default_workers()})")
    index.add_argument("--tokenizer", help="text length measure: regex, whitespace, bytes or module:function")
    index.add_argument("--no-progress", action="store_true", help="no progress bar")
    index.set_defaults(run=_run_index)

    plan = sub.add_parser("plan", help="print which samples each rank receives at each step (JSON lines)")
    plan.add_argument("index", metavar="INDEX_DIR")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--seed", type=int)
    plan.add_argument("--epoch", type=int, help="start epoch (new run) and the epoch to deliver fully")
    plan.add_argument("--grad-accum", type=int, default=1)
    plan.add_argument("--batch-size", type=int, help="samples per micro-batch (default 8)")
    plan.add_argument("--shuffle", choices=["permutation", "shard_block", "none"])
    plan.add_argument("--shards-per-window", type=int)
    plan.add_argument("--drop-last", action="store_true", default=None)
    plan.add_argument("--window-size", type=int, help="samples per window (default 4096)")
    plan.add_argument("--budget", type=float, help="cost budget per micro-batch: length-bucketed batches instead of --batch-size")
    plan.add_argument("--packing", action="store_true", help="with --budget: pack sequences of tokens up to the budget")
    plan.add_argument("--overlong", choices=["reject", "alone", "split"],
                      help="a sample over the budget: reject (error), alone (own micro-batch), split (packing)")
    plan.add_argument("--stats", action="store_true", help="print one JSON object: padding, balance, and the same for fixed-size batches")
    plan.add_argument("--worst", type=int, metavar="N", help="print the N costliest micro-batches (JSON lines)")
    plan.add_argument("--config", help="YAML file; its 'plan' section is a PlanConfig")
    plan.add_argument("--steps", type=int, help="steps to deal (default: until the epoch is fully delivered)")
    plan.add_argument("--resume", metavar="STATE_JSON", help="continue from a saved state (any world size)")
    plan.add_argument("--save-state", metavar="STATE_JSON", help="write the state after the last step")
    plan.set_defaults(run=_run_plan)

    verify = sub.add_parser("verify", help="check delivery logs cover an epoch exactly once")
    verify.add_argument("--index", required=True, metavar="INDEX_DIR")
    verify.add_argument("--epoch", type=int, required=True)
    verify.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines delivery logs ('-' for stdin)")
    verify.set_defaults(run=_run_verify)
    return parser


def _section(path: str | None, name: str) -> dict[str, Any]:
    if not path:
        return {}
    data = load_yaml(path)
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise ValueError(f"{path}: section {name!r} must be a mapping")
    return section


def _run_index(args: argparse.Namespace) -> int:
    values = _section(args.config, "index")
    values.setdefault("workers", default_workers())
    for flag in ("partitions", "workers", "tokenizer"):
        if getattr(args, flag) is not None:
            values[flag] = getattr(args, flag)
    report = build_index(args.sources, args.out, IndexConfig(**values), progress=not args.no_progress)
    summary = {"index": str(report.path), "samples": report.num_samples, "shards": report.shards,
               "fingerprint": report.fingerprint, "errors": len(report.errors)}
    print(json.dumps(summary))
    for error in report.errors:
        print(f"omnifeed: error: {error['error']}", file=sys.stderr)
    if report.errors:
        print(f"omnifeed: error: {len(report.errors)} problem(s); the index holds the rest. "
              "Fix or remove the sources named above and re-run `omnifeed index`.", file=sys.stderr)
        return 1
    return 0


def _plan_config(args: argparse.Namespace, saved: dict[str, Any] | None) -> PlanConfig:
    values = dict(saved or {}) | _section(args.config, "plan")
    for flag in ("seed", "batch_size", "shuffle", "shards_per_window", "drop_last", "window_size"):
        if getattr(args, flag) is not None:
            values[flag] = getattr(args, flag)
    if args.budget is not None:
        bucketing = dict(values.get("bucketing") or {}) | {"budget": args.budget}
        values["bucketing"] = (bucketing | ({"mode": "packing"} if args.packing else {})
                               | ({"overlong": args.overlong} if args.overlong else {}))
    elif args.packing:
        raise ValueError("--packing needs --budget (tokens per pack)")
    return PlanConfig(**values)


def _run_plan(args: argparse.Namespace) -> int:
    index = SampleIndex(args.index)
    saved = _read_state_file(args.resume) if args.resume else None
    plan = Plan.from_index(index, _plan_config(args, saved["plan"] if saved else None))
    if plan.dropped_per_epoch:
        logging.warning("drop_last: %d samples of every epoch are not delivered", plan.dropped_per_epoch)
    cursor = PlanCursor(plan, world_size=args.world_size, grad_accum=args.grad_accum,
                        epoch=0 if saved else (args.epoch or 0))
    if saved:
        cursor.load_state_dict(saved["state"])
    target = cursor.epoch if args.epoch is None else args.epoch
    out = sys.stdout
    report = PlanReport(plan, worst=args.worst or 0) if args.stats or args.worst else None
    for step in _steps(cursor, target, args.steps):
        if report is None:
            for record in delivery_records(step, index):
                out.write(json.dumps(record) + "\n")
        else:
            report.add(step)
    if report is not None and args.stats:
        out.write(json.dumps(_stats(report, index, plan, args)) + "\n")
    if report is not None and args.worst:
        for row in report.costliest():
            row["keys"] = index.keys(row.pop("positions"))
            out.write(json.dumps(row) + "\n")
    out.flush()
    if args.save_state:
        state = {"plan": plan.config.model_dump(), "state": cursor.state_dict()}
        Path(args.save_state).write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    return 0


def _steps(cursor: PlanCursor, epoch: int, steps: int | None) -> Iterator[Step]:
    """``steps`` steps, or (without a count) steps until ``epoch`` is fully delivered."""
    dealt = 0
    while (not cursor.epoch_delivered(epoch)) if steps is None else dealt < steps:
        yield cursor.next_step()
        dealt += 1


def _stats(report: PlanReport, index: SampleIndex, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    """The plan's figures beside those of fixed-size batches of ``--batch-size`` over the same epoch."""
    stats = report.stats()
    if plan.bucketing is not None:
        naive_config = plan.config.model_copy(update={"bucketing": None})
        naive_plan = Plan.from_index(index, naive_config)
        naive = PlanReport(naive_plan, cost=plan.bucketing.cost)
        naive_cursor = PlanCursor(naive_plan, world_size=args.world_size, grad_accum=args.grad_accum, epoch=_report_epoch(args))
        for step in _steps(naive_cursor, _report_epoch(args), args.steps):
            naive.add(step)
        stats["fixed_batch_size"] = {"batch_size": naive_config.batch_size, **naive.stats()}
    return stats


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


def _run_verify(args: argparse.Namespace) -> int:
    index = SampleIndex(args.index)
    report = verify_coverage(index, args.epoch, read_delivery_logs(args.logs, stdin=sys.stdin))
    print(json.dumps(report.to_json()))
    return 0 if report.ok else 1


def _run_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(Path(args.out), samples=args.samples)


if __name__ == "__main__":
    sys.exit(main())
