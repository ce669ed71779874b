"""`omnifeed precache --ray`: the same partition tasks as Ray tasks, to warm every node's NVMe tier.

One task per (alive node with CPUs, partition), pinned to its node
(``NodeAffinitySchedulingStrategy(soft=False)``): each node fills its own tier at the same
local path. A task is a Ray generator: it yields its progress and then its result, which the
driver reads as they come (``ray.wait`` over the generators). Every node needs omnifeed
installed and must read the index directory at the same path (a shared filesystem) and reach
the sources. Ray is an optional extra (``pip install 'omnifeed[ray]'``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from omnifeed.loader import OmnifeedError
from omnifeed.loader.index import ray_session

from ._precache import Counts, PartitionResult, PrecacheJob, run_partition
from ._precache_run import PrecacheReport, RunTracker

_POLL_S = 0.2


def precache_on_ray(
    job: PrecacheJob, partitions: Sequence[int], *, address: str | None = None, progress: bool = True
) -> PrecacheReport:
    """Precache ``partitions`` into the tier of every alive node of the Ray cluster at ``address``.

    ``address`` None or "auto" joins the cluster this machine belongs to; a Ray connection this
    process already holds is used as it is. Raises OmnifeedError when Ray is missing, no cluster
    answers, the cluster has no node with CPUs, or a task fails beyond Ray's retries.
    """
    with ray_session(address) as ray:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
        if not nodes:
            raise OmnifeedError("the Ray cluster has no alive node with CPUs to run precache tasks on")
        tracker = RunTracker(job, partitions, nodes=len(nodes), progress=progress)
        try:
            task = ray.remote(num_cpus=1)(_ray_partition)
            running: dict[Any, tuple[str, int]] = {}
            for node in nodes:
                strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                for partition in partitions:
                    running[task.options(scheduling_strategy=strategy).remote(job, partition)] = (node, partition)
            while running:
                ready, _ = ray.wait(list(running), num_returns=len(running), timeout=_POLL_S)
                for generator in ready:
                    _next_item(ray, generator, running, tracker)
        except BaseException:
            tracker.bar.close()
            raise
        return tracker.report()


def _next_item(ray: Any, generator: Any, running: dict[Any, tuple[str, int]], tracker: RunTracker) -> None:
    """Take the next item a ready task generator yielded: progress, its result, or its end."""
    node, partition = running[generator]
    try:
        item = ray.get(next(generator))
    except StopIteration:
        running.pop(generator)
        return
    except ray.exceptions.RayError as exc:
        raise OmnifeedError(
            f"the precache task of partition {partition} on node {node} failed: "
            f"{type(exc).__name__}: {exc}; what it cached is kept: run the command again"
        ) from exc
    if isinstance(item, PartitionResult):
        tracker.finish(item)
    else:
        tracker.update(item)


def _ray_partition(job: PrecacheJob, partition: int) -> Iterator[Counts | PartitionResult]:
    """A Ray task (generator): one partition into this node's tier."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    for item in run_partition(job, partition):
        if isinstance(item, PartitionResult):
            item.node = f"{ray.util.get_node_ip_address()} ({node[:12]})"
        yield item
