"""`omnifeed index` and `precache`: the commands that build an index or read one (`plan`'s runner: `_plan_cmd`).

Each maps its flags one-to-one onto the typed configs (a flag's error names the flag, not the
file); `tools/_cli.py` holds the parser and calls ``run_*`` with the parsed arguments.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

from omnifeed.cache import NvmeTierConfig
from omnifeed.loader import (
    FeedConfig,
    IndexConfig,
    SampleIndex,
    build_index,
    load_yaml,
    validated,
)
from omnifeed.loader.index import default_workers

from ._exit_codes import INDEX_DAMAGED_EXIT
from ._index_summary import summary_json, summary_lines
from ._precache import PrecacheJob
from ._stop_signals import stops_on_sigterm

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
