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
from ._index_flags import add_index_commands

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

    add_index_commands(sub, _command, _runs)

    verify = _command(
        sub,
        "verify",
        "check delivery logs cover an epoch exactly once (a mixture's: each source as planned)",
        "omnifeed verify index delivery.jsonl --epoch 0",
        "omnifeed plan --config mix.yaml --world-size 2 | omnifeed verify --config mix.yaml - --epoch 0",
    )
    verify.usage = "omnifeed verify [-h] (INDEX_DIR | --config FILE) LOG [LOG ...] --epoch EPOCH"
    verify.add_argument("index", nargs="?", metavar="INDEX_DIR", help="the index the logs were delivered from")
    verify.add_argument(
        "logs", nargs="*", metavar="LOG", help="JSON-lines delivery logs or service audit logs ('-' for stdin)"
    )
    verify.add_argument("--epoch", type=int, required=True, help="the epoch to check")
    verify.add_argument(
        "--config",
        metavar="FILE",
        help="instead of INDEX_DIR: a feed or plan config whose plan has a mixture; checks each source "
        "against the plan's schedule (its seed, weights, phases) and reports realised shares per source",
    )
    verify.add_argument("--index", dest="legacy_index", metavar="INDEX_DIR", help=argparse.SUPPRESS)  # before 0.2
    verify.set_defaults(run=_runs("._verify_cmd", "run_verify"), trailing="logs")

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
