"""`omnifeed index --ray`: scan shards as Ray tasks on an existing cluster, write the index here.

The scan is the one the local pool runs (``_scan_pool.scan_job``), one Ray task per group of
shards; the driver spills, sorts and writes exactly as a local build does, so the index (rows,
manifest, fingerprint) is the same. Every node needs omnifeed installed and must reach the
source URLs; the index is written on the machine that runs the command.

Ray is an optional extra (``pip install 'omnifeed[ray]'``), imported on first use.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from .._errors import OmnifeedError
from ._build import build_index
from ._config import IndexConfig
from ._partition_writer import IndexReport
from ._records import ShardSpec
from ._scan_pool import ScanResult, scan_job

log = logging.getLogger(__name__)

INSTALL_RAY = "pip install 'omnifeed[ray]'"
_MAX_SHARDS_PER_TASK = 64
_TASKS_PER_CPU = 4  # small enough groups that a slow shard does not hold the tail
_IN_FLIGHT_PER_CPU = 2  # tasks submitted ahead: bounds the rows waiting at the driver
_CONNECT_TIMEOUT_S = 10.0


def import_ray() -> ModuleType:
    """The ``ray`` module; raises OmnifeedError saying how to install it when it is missing."""
    try:
        import ray
    except ImportError as exc:
        raise OmnifeedError(f"--ray needs Ray, an optional extra: {INSTALL_RAY}") from exc
    return ray


@contextmanager
def ray_session(address: str | None) -> Iterator[ModuleType]:
    """Connect to the Ray cluster at ``address`` (None or "auto": the one this machine belongs to).

    An existing connection of this process is used as it is and left open; a connection made
    here is closed on exit. Raises OmnifeedError naming the address when no cluster answers.
    """
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    target = address or "auto"
    check_reachable(target)
    try:
        ray.init(address=target, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise OmnifeedError(
            f"cannot connect to a Ray cluster at {target!r} ({exc}); start one with `ray start --head` "
            "(then run the command on a node of it), or pass its address: --ray HOST:PORT"
        ) from exc
    try:
        yield ray
    finally:
        ray.shutdown()


def check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT that nothing listens on (Ray itself retries for minutes)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local": Ray finds or starts the cluster
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise OmnifeedError(
            f"no Ray cluster answers at {address} ({exc}); check the address "
            "(the head node's GCS port, 6379 by default) and that the cluster is up"
        ) from exc


def cluster_cpus(ray: ModuleType) -> int:
    """CPUs of the cluster's alive nodes (at least 1)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def build_index_ray(
    sources: Sequence[str],
    out: str | Path,
    config: IndexConfig | None = None,
    *,
    address: str | None = None,
    progress: bool = True,
    shards_per_task: int | None = None,
) -> IndexReport:
    """`build_index` with shards scanned as Ray tasks (``config.workers`` is not used).

    ``shards_per_task`` defaults to a group size that gives every CPU of the cluster about
    four tasks (at most 64 shards each). Raises OmnifeedError when Ray is missing or no
    cluster answers at ``address``, and when a task fails beyond Ray's own retries.
    """
    if shards_per_task is not None and shards_per_task < 1:
        raise ValueError(f"shards_per_task must be at least 1, got {shards_per_task}")
    with ray_session(address) as ray:
        scanner = functools.partial(_scan_on_ray, ray, shards_per_task)
        return build_index(sources, out, config, progress=progress, scanner=scanner)


def _scan_group(jobs: list[tuple[int, ShardSpec, IndexConfig]]) -> list[ScanResult]:
    """One Ray task: scan a group of shards."""
    return [scan_job(job) for job in jobs]


def _scan_on_ray(
    ray: Any, shards_per_task: int | None, shards: list[ShardSpec], config: IndexConfig
) -> Iterator[ScanResult]:
    """Scan results as their tasks finish, at most a few tasks per CPU in flight."""
    cpus = cluster_cpus(ray)
    per_task = shards_per_task or max(1, min(_MAX_SHARDS_PER_TASK, math.ceil(len(shards) / (_TASKS_PER_CPU * cpus))))
    jobs = [(i, shard, config) for i, shard in enumerate(shards)]
    groups = [jobs[i : i + per_task] for i in range(0, len(jobs), per_task)]
    task = ray.remote(num_cpus=1)(_scan_group)
    log.info("scanning %d shards as %d Ray tasks on %d CPUs", len(shards), len(groups), cpus)
    waiting = iter(groups)
    in_flight: dict[Any, list[tuple[int, ShardSpec, IndexConfig]]] = {}
    for group in waiting:
        in_flight[task.remote(group)] = group
        if len(in_flight) >= _IN_FLIGHT_PER_CPU * cpus:
            break
    while in_flight:
        ready, _ = ray.wait(list(in_flight), num_returns=1)
        group = in_flight.pop(ready[0])
        try:
            results: list[ScanResult] = ray.get(ready[0])
        except ray.exceptions.RayError as exc:
            urls = ", ".join(shard.url for _, shard, _ in group[:3]) + (" ..." if len(group) > 3 else "")
            raise OmnifeedError(
                f"a Ray scan task failed on shards {urls}: {type(exc).__name__}: {exc}; "
                "check the nodes' logs (`ray logs`), or index without --ray to see the error here"
            ) from exc
        next_group = next(waiting, None)
        if next_group is not None:
            in_flight[task.remote(next_group)] = next_group
        yield from results
