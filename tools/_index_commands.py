"""`omnifeed index`, `precache` and `plan`: the commands that build an index or read one.

Each maps its flags one-to-one onto the typed configs (a flag's error names the flag, not the
file); `tools/_cli.py` holds the parser and calls ``run_*`` with the parsed arguments.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

from omnifeed.cache import NvmeTierConfig
from omnifeed.loader import (
    FeedConfig,
    IndexConfig,
    Plan,
    PlanConfig,
    PlanCursor,
    SampleIndex,
    Step,
    build_index,
    delivery_records,
    load_yaml,
    validated,
)
from omnifeed.loader.index import default_workers
from omnifeed.loader.plan import PlanReport, budget_guidance, suggest_budget

from ._exit_codes import INDEX_DAMAGED_EXIT
from ._index_summary import summary_json, summary_lines
from ._precache import PrecacheJob
from ._stop_signals import stops_on_sigterm

_STATE_FILE_KEYS = ("plan", "state")
_FAILURES_SHOWN = 20


def _section(path: str | None, name: str) -> dict[str, Any]:
    """Section ``name`` of the YAML file ``path`` ({} without a file); a misspelled section is refused."""
    if not path:
        return {}
    data = _config_file(path)
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise ValueError(f"{path}: section {name!r} must be a mapping")
    return section


def _config_file(path: str) -> dict[str, Any]:
    """The YAML file ``path``, whose top level holds only the sections omnifeed reads (ConfigError otherwise)."""
    data = load_yaml(path)
    validated(_config_file_model(), data, source=path)  # `idnex:` → "idnex: unknown key; did you mean 'index'?"
    return data


@functools.cache
def _config_file_model() -> type[BaseModel]:
    """The top level of a config file: ``index`` and a feed config's sections (``plan``, ``decode``, ``cache``, ...),
    which one file may hold together (docs/config.md); unknown keys refused as every config's are."""
    sections: dict[str, Any] = {name: (Any, None) for name in ("index", *FeedConfig.model_fields)}
    return create_model("ConfigFile", __config__=ConfigDict(extra="forbid"), **sections)


def _flags(args: argparse.Namespace, names: Sequence[str]) -> dict[str, str]:
    """Config field → ``--flag`` for the flags given, so that an error names the flag rather than the file."""
    return {name: "--" + name.replace("_", "-") for name in names if getattr(args, name, None) is not None}


def run_index(args: argparse.Namespace) -> int:
    """`omnifeed index`: build the index, print what it holds (human or ``--json``); SIGTERM stops it as Ctrl-C."""
    return stops_on_sigterm(_run_index, "stopped; the partial index was removed, --out is as it was")(args)


_INDEX_FLAGS = (
    "partitions",
    "workers",
    "tokenizer",
    "key_column",
    "strict",
    "class_folders",
    "media_root",
    "allow_meta_only",
)


def _run_index(args: argparse.Namespace) -> int:
    values = _section(args.config, "index")
    values.setdefault("workers", default_workers())
    root = values.get("media_root")
    if args.config and isinstance(root, str) and "://" not in root and not Path(root).expanduser().is_absolute():
        values["media_root"] = str(Path(args.config).resolve().parent / root)  # a config's paths: beside the file
    flags = _flags(args, _INDEX_FLAGS)
    for flag in flags:
        values[flag] = getattr(args, flag)
    config = validated(IndexConfig, values, source=args.config, section=("index",), flags=flags)
    if args.ray is not None:
        from omnifeed.loader.index import build_index_ray

        check_ray_flags(args)
        report = build_index_ray(args.sources, args.out, config, address=args.ray, progress=not args.no_progress)
    else:
        report = build_index(args.sources, args.out, config, progress=not args.no_progress)
    for damaged in report.damaged:
        print(f"omnifeed: damaged ({damaged['reason']}): {damaged['error']}", file=sys.stderr)
    for error in report.errors:
        print(f"omnifeed: error: {error['error']}", file=sys.stderr)
    if report.damaged:
        print(
            f"omnifeed: {len(report.damaged)} damaged sample(s) left out, named above; the index holds the rest "
            "(--strict refuses their shards instead).",
            file=sys.stderr,
        )
    if report.errors:
        print(
            f"omnifeed: error: {len(report.errors)} problem(s); the index holds the rest. "
            "Fix or remove the sources named above and re-run `omnifeed index`.",
            file=sys.stderr,
        )
    sys.stderr.flush()
    print(json.dumps(summary_json(report)) if args.json else "\n".join(summary_lines(report)), flush=True)
    if report.errors:
        return 1
    return INDEX_DAMAGED_EXIT if report.damaged else 0


def check_ray_flags(args: argparse.Namespace) -> None:
    """--ray takes a cluster address, not a path; it replaces --workers."""
    if args.ray not in ("auto", "local") and ":" not in args.ray:
        raise ValueError(
            f"--ray {args.ray}: not a Ray address (HOST:PORT, ray://HOST:PORT or auto); "
            "put a bare --ray after the positional arguments"
        )
    if args.workers is not None:
        raise ValueError("--workers sets local processes; with --ray the cluster's CPUs do the work: drop one of them")


def run_precache(args: argparse.Namespace) -> int:
    """`omnifeed precache`: fill the NVMe tier from an index; SIGTERM stops it as Ctrl-C (what is cached stays)."""
    return stops_on_sigterm(_run_precache, "stopped; the entries cached so far are kept (run it again to go on)")(args)


def _run_precache(args: argparse.Namespace) -> int:
    from ._precache_run import precache_local

    if args.ray is not None:
        check_ray_flags(args)
    index = SampleIndex(args.index)
    job = _precache_job(args, index)
    partitions = _partition_list(args.partitions, len(index.manifest["partitions"]))
    if args.ray is not None:
        from ._ray import precache_on_ray

        report = precache_on_ray(job, partitions, address=args.ray, progress=not args.no_progress)
    else:
        workers = args.workers if args.workers is not None else default_workers()
        report = precache_local(job, partitions, workers=min(workers, len(partitions)), progress=not args.no_progress)
    print(json.dumps(report.summary()))
    for failure in report.failures[:_FAILURES_SHOWN]:
        print(f"omnifeed: warning: not cached: {failure}", file=sys.stderr)
    counts = report.counts
    if counts.failed > _FAILURES_SHOWN:
        print(f"omnifeed: warning: {counts.failed - _FAILURES_SHOWN} more entries failed", file=sys.stderr)
    if counts.not_held:
        print(
            f"omnifeed: warning: the tier turned away {counts.not_held} entries (an entry over 1/8 of the capacity, "
            f"or the tier is full at {job.nvme.capacity_bytes} bytes): raise --capacity",
            file=sys.stderr,
        )
    reason = report.could_not_run
    if reason is not None:
        print(f"omnifeed: error: {reason}", file=sys.stderr)
        return 1
    if counts.failed:
        print(
            f"omnifeed: warning: {counts.failed} entries failed and were left out (the feed reads them from the "
            "source, or replaces the sample); fix the sources named above and run precache again",
            file=sys.stderr,
        )
    return 0


def _precache_job(args: argparse.Namespace, index: SampleIndex) -> PrecacheJob:
    """The precache job of the flags and the feed config: the same keys and tier the feed will use."""
    if args.config:
        _config_file(args.config)  # a misspelled `index:` named as such, before the feed's own keys are checked
    feed = FeedConfig.from_yaml(args.config) if args.config else FeedConfig()
    cache = feed.cache
    if args.decode and args.config and cache.entries != "decoded":
        raise ValueError(
            f"--decode, but {args.config} has cache.entries: {cache.entries}, so the feed would not read "
            "decoded entries: set cache.entries: decoded there (then --decode is implied), or drop --decode"
        )
    path = args.cache or (cache.nvme.path if cache.nvme is not None else None)
    if path is None:
        raise ValueError("no cache directory: pass --cache DIR, or give a --config whose cache.nvme.path is set")
    nvme = (cache.nvme or NvmeTierConfig(path=path)).model_copy(update={"path": path})
    if args.capacity is not None:
        nvme = nvme.model_copy(update={"capacity_bytes": parse_bytes(args.capacity)})
    nvme = validated(
        NvmeTierConfig,
        nvme.model_dump(),
        source=args.config,
        section=("cache", "nvme"),
        flags={"capacity_bytes": "--capacity"} if args.capacity is not None else {},
    )  # what flags changed
    entries: Literal["raw", "decoded"] = "decoded" if args.decode else cache.entries
    return PrecacheJob(index=str(index.path), nvme=nvme, entries=entries, decode=feed.decode, remote=cache.remote)


_BYTE_UNITS = {
    "": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "b": 1,
}


def parse_bytes(text: str) -> int:
    """``500G`` → bytes: K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"--capacity {text!r}: give bytes, e.g. 500G, 64GiB or 1000000000")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def _partition_list(text: str | None, count: int) -> list[int]:
    """``0,3,8-11`` → sorted partitions; all of them when not given."""
    if text is None:
        return list(range(count))
    chosen: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"--partitions {text!r}: give numbers and ranges, e.g. 0,3,8-11") from None
        if not 0 <= low <= high < count:
            raise ValueError(
                f"--partitions {text!r}: {part.strip()} is outside the index's {count} partitions (0-{count - 1})"
            )
        chosen.update(range(low, high + 1))
    return sorted(chosen)


def _plan_config(args: argparse.Namespace, saved: dict[str, Any] | None) -> PlanConfig:
    values = dict(saved or {}) | _section(args.config, "plan")
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
    index = SampleIndex(args.index)
    saved = _read_state_file(args.resume) if args.resume else None
    if args.suggest_budget is not None:
        return _suggest(args, index, saved)
    plan = Plan.from_index(index, _plan_config(args, saved["plan"] if saved else None))
    if plan.dropped_per_epoch:
        logging.warning("drop_last: %d samples of every epoch are not delivered", plan.dropped_per_epoch)
    cursor = PlanCursor(
        plan, world_size=args.world_size, grad_accum=args.grad_accum, epoch=0 if saved else (args.epoch or 0)
    )
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


def _suggest(args: argparse.Namespace, index: SampleIndex, saved: dict[str, Any] | None) -> int:
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


def _stats(report: PlanReport, index: SampleIndex, plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
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
