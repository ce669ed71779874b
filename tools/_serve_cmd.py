"""`omnifeed serve`: the node's feed service in the foreground until SIGTERM or Ctrl-C (docs/service.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def run_serve(args: argparse.Namespace) -> int:
    """Serve ``args.config`` until a signal; a second signal exits at once."""
    import os
    import signal
    import threading

    from omnifeed.loader.service import FeedService, ServiceConfig

    config = ServiceConfig.from_yaml(args.config)
    overrides = {k: v for k, v in (("socket", args.socket), ("metrics_port", args.metrics_port)) if v is not None}
    if overrides:
        config = config.model_copy(update=overrides)
    if args.ray is not None:
        config = _with_ray(config, args.ray)
    service = FeedService(config)
    stop = threading.Event()

    def on_signal(number: int, _frame: object) -> None:
        if stop.is_set():  # a second SIGTERM / Ctrl-C: do not wait for the clean stop
            print(f"omnifeed: {signal.Signals(number).name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + number)
        stop.set()

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, on_signal)
    service.start()
    metrics = (
        f", metrics at http://{config.metrics_host}:{service.metrics_port}/metrics" if service.metrics_port else ""
    )
    mixture = config.feed.plan.mixture
    served = config.index if mixture is None else f"the mixture of {', '.join(mixture.sources)}"
    print(f"omnifeed: serving {served} at {config.socket}{metrics}", flush=True)
    ram = config.feed.cache.ram
    if ram is not None:  # it outlives the service by design (a warm restart): say where it is and how it goes
        print(
            f"omnifeed: RAM cache tier '{ram.name}' in /dev/shm ({ram.capacity_bytes / 2**30:.3g} GiB, kept after the "
            f"service stops for a warm restart); list with `omnifeed cache list`, free with "
            f"`omnifeed cache remove {ram.name}`",
            flush=True,
        )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        exit_within(_STOP_DEADLINE_S)
        service.stop()
    print("omnifeed: service stopped", flush=True)
    return 0


def _with_ray(config: Any, address: str) -> Any:
    """``config`` with remote decode workers at ``address`` (`omnifeed serve --ray`)."""
    data = config.model_dump()
    pools = data["feed"]["pools"]
    configured = [m for m, pool in pools.items() if pool.get("remote")] or ["image", "video", "audio"]
    for modality in configured:
        pool = pools.get(modality) or config.feed.pool(modality).model_dump()
        processes = config.feed.pool(modality).decode_processes  # the local side beside the actors keeps them
        remote = {**(pool.get("remote") or {}), "address": address}
        pools[modality] = {**pool, "executor": "ray", "processes": processes, "remote": remote}
    return type(config).model_validate(data)


_STOP_DEADLINE_S = 30.0  # SIGTERM ends `omnifeed serve` within this, its cleanup finished or not (docs/service.md)


def exit_within(seconds: float) -> None:
    """From now on the process ends within ``seconds``: a daemon timer exits it (status 1) if stopping hangs.

    The timer also outlives ``main``: it covers the interpreter's exit (atexit hooks, finalizers).
    """
    import os
    import threading

    def give_up() -> None:
        print(
            f"omnifeed: the service did not stop within {seconds:g} s; exiting without finishing its cleanup",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
