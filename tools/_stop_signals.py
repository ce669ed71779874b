"""SIGTERM stops `omnifeed index` and `omnifeed precache` as Ctrl-C does, with exit status 143.

Slurm and Kubernetes stop a job with SIGTERM, whose default action ends the process at once: no
``finally`` runs, so a build's ``.NAME.building-*`` folder and the worker pool's semaphores were
left behind. Here SIGTERM raises `Terminated` (a ``KeyboardInterrupt``) in the main thread, so
every cleanup written for Ctrl-C runs for it too: scan and precache workers are stopped, the
partial index removed, the pool's semaphores released; the command then exits ``128 + 15``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from types import FrameType

TERMINATED_EXIT = 128 + signal.SIGTERM
"""Exit status of a command stopped by SIGTERM (143), as a shell reports a process killed by it."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: raised in the main thread, where Ctrl-C's KeyboardInterrupt would be."""


def _raise_terminated(number: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop at a time: a second SIGTERM does not cut the cleanup
    raise Terminated()


def stops_on_sigterm(run: Callable[[argparse.Namespace], int], what: str) -> Callable[[argparse.Namespace], int]:
    """``run`` with SIGTERM turned into `Terminated`; stopped by it, one line on stderr saying ``what`` happened, and
    exit status `TERMINATED_EXIT`."""

    def stoppable(args: argparse.Namespace) -> int:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            return run(args)
        except Terminated:
            print(f"omnifeed: terminated (SIGTERM): {what}", file=sys.stderr, flush=True)
            return TERMINATED_EXIT
        finally:
            signal.signal(signal.SIGTERM, previous)

    return stoppable
