"""The `omnifeed` command line: demo, index, precache, serve, stats, plan, verify, chaos, bench.

Each command maps its flags one-to-one onto the typed configs of ``omnifeed.loader``.
Exit status: 0 on success, 1 with a one-line reason on a handled error, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._bench_cmd import add_bench_commands
from ._cache_cmd import add_cache_command
from ._exit_codes import INDEX_DAMAGED_EXIT

# Nothing heavy is imported here (no numpy, pyarrow, pydantic, torch, PIL, av, lmdb): `omnifeed --help`,
# `--version` and every `COMMAND --help` parse flags only; a command imports what it needs when it runs
# (tests/tools/test_startup.py lists what `omnifeed --help` may import).

__version__ = "0.1.0"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `omnifeed` console script."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    trailing: str | None = getattr(args, "trailing", None)  # positionals that may follow the options (verify's LOGs)
    if extra:
        if trailing is None or any(arg.startswith("-") and arg != "-" for arg in extra):
            parser.parse_args(argv)  # argparse's own "unrecognized arguments" (exit 2)
        else:
            setattr(args, trailing, [*getattr(args, trailing), *extra])
    logging.basicConfig(level=logging.WARNING if not args.verbose else logging.INFO, format="omnifeed: %(message)s")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("omnifeed: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = _user_error(exc)
        if message is None:  # not the user's mistake: a bug, shown in full
            raise
        if args.debug:
            traceback.print_exc()
        print(f"omnifeed: error: {message}", file=sys.stderr)
        return 1


def _user_error(exc: Exception) -> str | None:
    """The one-line message of an error the user can fix; None for anything else (a bug)."""
    from pydantic import ValidationError

    from omnifeed.loader import OmnifeedError, describe_validation_error

    if isinstance(exc, ValidationError):  # a config built from flags or code, not from a YAML file
        return describe_validation_error(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, (OmnifeedError, OSError, ValueError)):
        return str(exc)
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnifeed",
        description="Data-pipeline-first loader for multimodal training.",
        formatter_class=_HelpFormatter,
        epilog=_examples("omnifeed demo", "omnifeed COMMAND --help"),
    )
    parser.add_argument("--version", action="version", version=f"omnifeed {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("--debug", action="store_true", help="on an error, print its traceback too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _command(
        sub,
        "demo",
        "build the built-in dataset, index it, plan through a resize, verify",
        "omnifeed demo",
        "omnifeed demo --out /tmp/omnifeed-demo --samples 480",
    )
    demo.add_argument("--out", default="demo-output", help="working directory (recreated)")
    demo.add_argument("--samples", type=int, default=240, help="samples in the generated dataset")
    demo.set_defaults(run=_run_demo)

    serve = _command(
        sub,
        "serve",
        "run the node's feed service: trainer ranks connect with FeedClient",
        "omnifeed serve --config service.yaml",
        "omnifeed serve --config service.yaml --socket ~/.omnifeed/feed.sock --metrics-port 9100",
    )
    serve.add_argument("--config", required=True, help="YAML service config (index, feed, socket, metrics_port, ...)")
    serve.add_argument("--socket", help="Unix socket path (overrides the config's)")
    serve.add_argument(
        "--metrics-port", type=int, help="Prometheus endpoint port (overrides the config's; 0: any free)"
    )
    serve.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="decode on a Ray cluster as well (default: auto): the address of every pools.*.remote, "
        "or 2 actors each for image, video and audio when none is configured; needs Ray installed",
    )
    serve.set_defaults(run=_runs("._serve_cmd", "run_serve"))

    index = _command(
        sub,
        "index",
        "scan sources into a hash-partitioned sample index",
        "omnifeed index 'shards/train-{0000..0099}.tar' --out index --config omnifeed.yaml --workers 8",
        "omnifeed index hf/train-00000-of-00002.parquet hf/train-00001-of-00002.parquet --out index",
    )
    index.description = (
        f"{index.description}. Exit status: 0 every sample indexed; {INDEX_DAMAGED_EXIT} indexed, "
        "with damaged samples left out (each named on stderr, counted in the manifest); "
        "1 a source, a shard or a key refused (the index holds the rest) or an error; "
        "143 stopped by SIGTERM (nothing written). Sources: docs/your-data.md."
    )
    index.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="tar shards, Parquet or Arrow files, folders (fsspec URLs, globs, {a..b})",
    )
    index.add_argument("--out", required=True, help="index directory to write")
    index.add_argument("--config", help="YAML file; its 'index' section is an IndexConfig")
    index.add_argument("--partitions", type=int, help="Parquet partitions (default 16)")
    index.add_argument("--workers", type=int, help="scan processes (default: the CPUs this process may run on)")
    index.add_argument("--tokenizer", help="text length measure: regex, whitespace, bytes or module:function")
    index.add_argument(
        "--key-column",
        metavar="NAME",
        help="Parquet/Arrow column holding the sample key (default __key__, else keys '<file stem>/<row>')",
    )
    index.add_argument(
        "--strict",
        action="store_true",
        default=None,
        help="refuse a whole shard at its first damaged sample, instead of leaving that sample out",
    )
    index.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="scan on the Ray cluster at ADDRESS (HOST:PORT; default: auto, the one this machine is in), "
        "one task per group of shards; needs pip install 'omnifeed[ray]'",
    )
    index.add_argument(
        "--class-folders",
        choices=["auto", "always", "never"],
        help="folder sources: class folders as an int64 'label' (sorted names, as torchvision's "
        "ImageFolder); auto (default): when every sample is one media file in one of 2+ class folders",
    )
    index.add_argument(
        "--media-root",
        metavar="DIR",
        help="read Parquet/Arrow media cells that hold only a file path (datasets' to_parquet of local "
        "files) from beneath DIR, confined to it",
    )
    index.add_argument(
        "--allow-meta-only",
        action="store_true",
        default=None,
        help="index a folder whose samples have no image, video, audio or text field (a warning), "
        "instead of refusing it",
    )
    index.add_argument(
        "--json",
        action="store_true",
        help="print the summary as one JSON object (for scripts) instead of the human summary",
    )
    index.add_argument("--no-progress", action="store_true", help="no progress bar")
    index.set_defaults(run=_runs("._index_commands", "run_index"))

    precache = _command(
        sub,
        "precache",
        "fill the node's NVMe cache tier from an index ahead of training (resumable)",
        "omnifeed precache index --cache /local_nvme/omnifeed-cache --capacity 500G",
        "omnifeed precache index --config feed.yaml --partitions 0-7",
    )
    precache.add_argument("index", metavar="INDEX_DIR", help="an index written by `omnifeed index`")
    precache.add_argument(
        "--cache", metavar="DIR", help="NVMe tier directory, node-local (default: cache.nvme.path of --config)"
    )
    precache.add_argument(
        "--config",
        metavar="FEED_YAML",
        help="the feed's config: its decode and cache settings (entries, nvme, remote) are used, "
        "so the feed finds every entry",
    )
    precache.add_argument(
        "--decode",
        action="store_true",
        help="cache decoded values, as a feed with cache.entries: decoded reads them (default: as "
        "--config says, else raw bytes)",
    )
    precache.add_argument(
        "--capacity",
        metavar="BYTES",
        help="tier capacity: bytes, or with K/M/G/T (x1024) or KB/MB/GB/TB (x1000), e.g. 500G "
        "(default: --config's, else 64G)",
    )
    precache.add_argument(
        "--partitions", metavar="LIST", help="index partitions to cache, e.g. 0,3,8-11 (default: all)"
    )
    precache.add_argument(
        "--workers", type=int, metavar="N", help="local worker processes (default: the CPUs, at most one per partition)"
    )
    precache.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="run as Ray tasks, one per node and partition, on the cluster at ADDRESS (HOST:PORT; "
        "default: auto); needs pip install 'omnifeed[ray]'",
    )
    precache.add_argument("--no-progress", action="store_true", help="no progress bar")
    precache.set_defaults(run=_runs("._index_commands", "run_precache"))

    plan = _command(
        sub,
        "plan",
        "print which samples each rank receives at each step (JSON lines)",
        "omnifeed plan index --world-size 8 --batch-size 32 --steps 10 --save-state state.json",
        "omnifeed plan index --world-size 4 --resume state.json",
    )
    plan.add_argument("index", metavar="INDEX_DIR", help="an index written by `omnifeed index`")
    plan.add_argument("--world-size", type=int, required=True, help="data-parallel ranks sharing each step")
    plan.add_argument("--seed", type=int, help="shuffle seed (default 0)")
    plan.add_argument("--epoch", type=int, help="start epoch (new run) and the epoch to deliver fully")
    plan.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step (default 1)")
    plan.add_argument("--batch-size", type=int, help="samples per micro-batch (default 8)")
    plan.add_argument(
        "--shuffle",
        choices=["permutation", "shard_block", "none"],
        help="permutation (all samples, default), shard_block (shuffled shards, sequential reads) or none",
    )
    plan.add_argument("--shards-per-window", type=int, help="shards per window with --shuffle shard_block (default 4)")
    plan.add_argument(
        "--drop-last",
        action="store_true",
        default=None,
        help="drop each epoch's last, short micro-batch (fixed-size batches)",
    )
    plan.add_argument(
        "--window-size",
        type=int,
        help="samples per window of the shuffled stream (default: 64 "
        "micro-batches' worth; 65,536 samples with --budget)",
    )
    plan.add_argument(
        "--budget", type=float, help="cost budget per micro-batch: length-bucketed batches instead of --batch-size"
    )
    plan.add_argument("--packing", action="store_true", help="with --budget: pack sequences of tokens up to the budget")
    plan.add_argument(
        "--overlong",
        choices=["reject", "alone", "split"],
        help="a sample over the budget: reject (error), alone (own micro-batch), split (packing)",
    )
    plan.add_argument(
        "--stats",
        action="store_true",
        help="print one JSON object: padding, balance, and the same for fixed-size batches",
    )
    plan.add_argument("--worst", type=int, metavar="N", help="print the N costliest micro-batches (JSON lines)")
    plan.add_argument(
        "--suggest-budget",
        type=float,
        metavar="N",
        help="print the cost budget whose micro-batches hold N samples on average (JSON); "
        "the cost model comes from --config",
    )
    plan.add_argument("--config", help="YAML file; its 'plan' section is a PlanConfig")
    plan.add_argument("--steps", type=int, help="steps to deal (default: until the epoch is fully delivered)")
    plan.add_argument("--resume", metavar="STATE_JSON", help="continue from a saved state (any world size)")
    plan.add_argument("--save-state", metavar="STATE_JSON", help="write the state after the last step")
    plan.set_defaults(run=_runs("._index_commands", "run_plan"))

    verify = _command(
        sub,
        "verify",
        "check delivery logs cover an epoch exactly once",
        "omnifeed verify index delivery.jsonl --epoch 0",
        "omnifeed plan index --world-size 2 | omnifeed verify index - --epoch 0",
    )
    verify.usage = "omnifeed verify [-h] INDEX_DIR LOG [LOG ...] --epoch EPOCH"
    verify.add_argument("index", nargs="?", metavar="INDEX_DIR", help="the index the logs were delivered from")
    verify.add_argument(
        "logs", nargs="*", metavar="LOG", help="JSON-lines delivery logs or service audit logs ('-' for stdin)"
    )
    verify.add_argument("--epoch", type=int, required=True, help="the epoch to check")
    verify.add_argument("--index", dest="legacy_index", metavar="INDEX_DIR", help=argparse.SUPPRESS)  # before 0.2
    verify.set_defaults(run=_run_verify, trailing="logs")

    stats = _command(
        sub,
        "stats",
        "print a running service's metrics live, and what limits throughput",
        "omnifeed stats",
        "omnifeed stats --socket ~/.omnifeed/feed.sock --once --json",
    )
    stats.add_argument(
        "--socket",
        metavar="SOCKET",
        help="the service's Unix socket (default: serve's, $TMPDIR/omnifeed-$UID/feed.sock)",
    )
    stats.add_argument("--address", dest="socket", metavar="SOCKET", help=argparse.SUPPRESS)  # before 0.2
    stats.add_argument(
        "--interval",
        type=_positive_seconds,
        default=2.0,
        metavar="SECONDS",
        help="seconds between refreshes (default 2)",
    )
    stats.add_argument("--once", action="store_true", help="print once and exit")
    stats.add_argument("--json", action="store_true", help="print the raw snapshot (one JSON object per refresh)")
    stats.set_defaults(run=_run_stats)

    add_bench_commands(sub, _command)

    add_cache_command(
        _command(
            sub,
            "cache",
            "list and remove the node's cache tiers (RAM segments in /dev/shm, NVMe directories)",
            "omnifeed cache list --nvme /local_nvme",
            "omnifeed cache remove default",
        ),
        _command,
    )
    return parser


def _command(sub: Any, name: str, summary: str, *examples: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows ``summary``, its options, and ``examples``; -v and --debug after it too."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress details")
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, print its traceback too"
    )
    command: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=summary,
        epilog=_examples(*examples),
        parents=[common],
        formatter_class=_HelpFormatter,
    )
    command.set_defaults(parser=command)
    return command


def _examples(*lines: str) -> str:
    return _EXAMPLES + "\n" + "\n".join(f"  {line}" for line in lines)


_EXAMPLES = "examples:"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps the description to the terminal, as the default formatter does; prints the examples as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(_EXAMPLES):
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def _runs(module: str, name: str) -> Any:
    """A command's runner, imported from ``module`` (of this package) when the command runs, not when flags parse."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(getattr(importlib.import_module(module, __package__), name)(args) or 0)

    return run


def _run_verify(args: argparse.Namespace) -> int:
    from omnifeed.loader import SampleIndex, read_delivery_logs, verify_coverage

    paths = ([args.index] if args.index is not None else []) + args.logs
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


def _run_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return run_demo(Path(args.out), samples=args.samples)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _run_stats(args: argparse.Namespace) -> int:
    """Print the service's metrics table (or JSON) every ``--interval`` seconds; once with ``--once``."""
    import time

    from omnifeed.loader.service import default_socket, request_metrics

    from ._stats import render_stats

    previous: dict[str, Any] | None = None
    clear = sys.stdout.isatty() and not args.once and not args.json
    address = args.socket or default_socket()
    try:
        while True:
            try:
                snapshot = request_metrics(address)
            except (OSError, EOFError) as exc:  # no socket, nobody listening, or it hung up
                cause = "" if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)) else f" ({exc})"
                print(
                    f"omnifeed: error: no omnifeed service at {address}: start it with "
                    f"`omnifeed serve --config FILE`{cause}",
                    file=sys.stderr,
                )
                return 1
            text = json.dumps(snapshot) if args.json else render_stats(snapshot, previous)
            print(("\x1b[H\x1b[2J" if clear else "") + text, flush=True)
            if args.once:
                return 0
            previous = snapshot
            time.sleep(args.interval)
    except KeyboardInterrupt:  # the way to leave the live view
        return 0


if __name__ == "__main__":
    sys.exit(main())
