"""`omnifeed verify`: delivery logs against one index (each sample once) or against a mixture's plan (per source)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def run_verify(args: argparse.Namespace) -> int:
    """Print the coverage report of ``--epoch`` as one JSON object; exit 0 only when it is ok."""
    from omnifeed.loader import SampleIndex, read_delivery_logs, verify_coverage

    paths = ([args.index] if args.index is not None else []) + args.logs
    if args.config is not None:
        if args.legacy_index is not None:
            args.parser.error(f"--config {args.config} names the mixture's indexes: drop --index")
        if not paths:
            args.parser.error("give one or more delivery logs (LOG, or - for stdin) after --config")
        folders = [path for path in paths if os.path.isdir(path)]
        if folders:
            raise ValueError(f"--config {args.config} names the mixture's indexes: drop INDEX_DIR {folders[0]}")
        return _verify_mixture(args.config, args.epoch, paths)
    if args.legacy_index is not None:  # the spelling before 0.2: --index INDEX_DIR, every positional a log
        index_dir, logs = args.legacy_index, paths
    else:
        index_dir, logs = (paths[0], paths[1:]) if paths else (None, [])
    if index_dir is None or not logs:
        args.parser.error("give the index directory, then one or more delivery logs (LOG, or - for stdin)")
    index = SampleIndex(index_dir)
    report = verify_coverage(index, args.epoch, read_delivery_logs(logs, stdin=sys.stdin))
    print(json.dumps(report.to_json()))
    return 0 if report.ok else 1


def _verify_mixture(config_file: str, epoch: int, logs: list[str]) -> int:
    """The logs against mixture epoch ``epoch`` of the plan ``config_file`` describes, source by source."""
    from omnifeed.loader import Plan, read_delivery_logs
    from omnifeed.loader.plan import open_mixture, verify_mixture

    config = _plan_of(config_file)
    if config.mixture is None:
        raise ValueError(
            f"{config_file}: its plan section has no mixture; for one index give the index directory instead "
            "(omnifeed verify INDEX_DIR LOG ...)"
        )
    index = open_mixture(config.mixture)
    report = verify_mixture(index, Plan.from_index(index, config), epoch, read_delivery_logs(logs, stdin=sys.stdin))
    print(json.dumps(report.to_json()))
    if not report.ok:
        failing = [
            f"{name} ({s.missing} missing, {s.duplicates} duplicated)"
            for name, s in report.sources.items()
            if s.missing or s.duplicates
        ]
        extra = [f"{n} {what}" for n, what in ((report.unknown, "unknown keys"), (report.partial, "partial")) if n]
        print(f"omnifeed: epoch {epoch} not delivered as planned: {', '.join(failing + extra)}", file=sys.stderr)
    return 0 if report.ok else 1


def _plan_of(config_file: str) -> Any:
    """The plan section of a feed or `omnifeed plan` config, or of a service config's feed (paths beside the file)."""
    import yaml

    from omnifeed.loader import FeedConfig
    from omnifeed.loader.service import ServiceConfig

    with open(config_file, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if isinstance(data, dict) and "feed" in data:
        return ServiceConfig.from_yaml(config_file).feed.plan
    return FeedConfig.from_yaml(config_file).plan
