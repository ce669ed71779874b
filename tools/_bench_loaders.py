"""One loader running one pipeline for one epoch, in its own process (the child side of `omnifeed bench`).

    python -m omnifeed.tools._bench_loaders '{"loader": "dataloader", "pipeline": "image", ...}'

Every Python loader runs the same decode code (omnifeed's decoders, which are Pillow, PyAV and
the tokenizer) and the same collate (omnifeed's batch format), with the same number of CPU
workers, so the figures compare the loaders, not the decoders. DALI decodes with its own
libjpeg-turbo pipeline, as its users would run it. Prints one JSON line: samples, seconds to
the first batch, seconds after it, CPU seconds of this process and every child it waited for.
The peer loaders are `_bench_peers`; `RunSpec` and the shared decode and collate code `_bench_spec`.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omnifeed.loader import FIELD_MODALITIES, FeedConfig, PlanConfig, PoolConfig

from ._bench_peers import (
    prepare,
    run_dali,
    run_dataloader,
    run_litdata,
    run_statefuldataloader,
    run_streaming,
    run_webloader,
)
from ._bench_spec import RunSpec, decode_config

IMAGE_ONLY = frozenset({"omnifeed-draft", "omnifeed-processes", "dali"})


# -- omnifeed ------------------------------------------------------------------------------
def feed_config(spec: RunSpec, draft: bool = False, processes: bool = False) -> FeedConfig:
    """The feed with ``workers`` decode threads in all (one pool for images; shared threads for the mixed set).

    ``processes``: images decode in ``workers`` processes writing into shared memory instead (two
    threads per process hand them the tasks).
    """
    if spec.pipeline == "image":
        image = (
            PoolConfig(workers=2 * spec.workers, processes=spec.workers, buffer_samples=4 * spec.batch_size)
            if processes
            else PoolConfig(workers=spec.workers, buffer_samples=4 * spec.batch_size)
        )
        pools = {"image": image, "text": PoolConfig(workers=0), "meta": PoolConfig(workers=0)}
        shared = 0
    else:
        pools = {m: PoolConfig(workers=0) for m in FIELD_MODALITIES}
        shared = spec.workers
    return FeedConfig(
        plan=PlanConfig(seed=0, batch_size=spec.batch_size),
        decode=decode_config(spec.pipeline, draft),
        pools=pools,
        shared_workers=shared,
    )


def run_omnifeed(spec: RunSpec, draft: bool = False, processes: bool = False) -> Iterable[dict[str, Any]]:
    """omnifeed's trainer client with the feed in this process."""
    from omnifeed.loader.service import ServiceConfig
    from omnifeed.trainer_adapter import FeedClient

    config = ServiceConfig(
        index=spec.index, feed=feed_config(spec, draft, processes), socket=str(Path(spec.work) / "unused.sock")
    )
    return _epoch(FeedClient.in_process(config))


def start_service(spec: RunSpec, work: Path, python: str = sys.executable) -> tuple[subprocess.Popen[bytes], str]:
    """`omnifeed serve` of ``spec``'s index and feed config in a child process, its files in ``work``;
    returns once it answers: the process and its socket."""
    import yaml

    from omnifeed.loader.service import MAX_SOCKET_PATH, wait_until_serving

    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o700)  # the service refuses a socket directory other users can enter
    socket, config = work / "feed.sock", work / "service.yaml"
    if len(os.fsencode(socket)) > MAX_SOCKET_PATH:  # a deep --out: the socket goes to a short private folder
        socket = Path(tempfile.mkdtemp(prefix="omnifeed-bench-")) / "feed.sock"
    config.write_text(
        yaml.safe_dump({"index": spec.index, "socket": str(socket), "feed": feed_config(spec).model_dump(mode="json")}),
        encoding="utf-8",
    )
    service = subprocess.Popen(
        [python, "-m", "omnifeed.tools", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_until_serving(
        str(socket),
        service,
        120.0,
        detail=lambda: service.stderr.read().decode() if service.poll() is not None and service.stderr else "",
    )
    return service, str(socket)


def run_omnifeed_service(spec: RunSpec) -> Iterable[dict[str, Any]]:
    """`omnifeed serve` in a child process and a FeedClient reading from it over shared memory."""
    from omnifeed.trainer_adapter import FeedClient

    service, socket = start_service(spec, Path(spec.work))
    return _ServiceEpoch(service, FeedClient(socket))


class _ServiceEpoch:
    """One epoch from a service child, then the service stopped; ``cpu_at_end``: the process tree's CPU seconds just
    before the stop (its producer processes are reaped by its fork server, which outlives it unreaped: their CPU
    would leave the tree with the service)."""

    def __init__(self, service: Any, client: Any) -> None:
        self._service, self._client = service, client
        self.cpu_at_end: float | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            yield from _epoch(self._client)
            self.cpu_at_end = _tree_cpu_seconds()
        finally:
            self._service.terminate()
            self._service.wait(timeout=60)


def _epoch(client: Any) -> Iterator[dict[str, Any]]:
    with client:
        yield from client


RUNNERS: dict[str, Callable[[RunSpec], Iterable[dict[str, Any]]]] = {
    "omnifeed": run_omnifeed,
    "omnifeed-draft": lambda spec: run_omnifeed(spec, draft=True),
    "omnifeed-processes": lambda spec: run_omnifeed(spec, processes=True),
    "omnifeed-service": run_omnifeed_service,
    "dataloader": run_dataloader,
    "webloader": run_webloader,
    "statefuldataloader": run_statefuldataloader,
    "streaming": run_streaming,
    "litdata": run_litdata,
    "dali": run_dali,
}
REQUIRES = {
    "webloader": "webdataset",
    "statefuldataloader": "torchdata",
    "streaming": "streaming",
    "litdata": "litdata",
    "dali": "nvidia.dali",
}


def batch_size_of(batch: Any) -> int:
    """Samples in a batch of any of the loaders."""
    if isinstance(batch, list):  # DALI: one dict per pipeline
        return int(batch[0]["pixels"].shape[0])
    return len(batch["__key__"])


def _cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _tree_cpu_seconds() -> float:
    """CPU seconds so far of this process and every live descendant (workers, the service and its workers)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def run(spec: RunSpec) -> dict[str, Any]:
    """One epoch of ``spec``: samples, time to the first batch, then the steady part after it (seconds and CPU
    seconds of this process tree, so start-up costs such as imports and worker spawning are apart)."""
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    source = RUNNERS[spec.loader](spec)
    batches = iter(source)
    samples, first_at, first_samples, first_cpu = 0, 0.0, 0, 0.0
    for batch in batches:
        n = batch_size_of(batch)
        if not samples:
            first_at, first_samples, first_cpu = time.perf_counter(), n, _tree_cpu_seconds()
        samples += n
        del batch
    end, end_cpu = time.perf_counter(), _tree_cpu_seconds()
    end_cpu = getattr(source, "cpu_at_end", None) or end_cpu
    del batches, source  # workers joined before the whole run's CPU is counted
    return {
        "samples": samples,
        "first_batch_s": round(first_at - start, 3),
        "steady_s": round(end - first_at, 3),
        "steady_samples": samples - first_samples,
        "steady_cpu_s": round(end_cpu - first_cpu, 3),
        "cpu_s": round(_cpu_seconds() - cpu_start, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Child entry point: ``SPEC_JSON`` (``--prepare`` to write the converted format first)."""
    args = sys.argv[1:] if argv is None else argv
    spec = RunSpec(**json.loads(args[-1]))
    if "--prepare" in args:
        prepare(spec)
        print(json.dumps({"prepared": spec.converted}))
        return 0
    print(json.dumps({**run(spec), "spec": asdict(spec)["loader"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
