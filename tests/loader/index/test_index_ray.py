"""The Ray scan's scheduling, against a stand-in for Ray: every shard once, a bounded number of tasks in flight."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from omnifeed.loader import IndexConfig, ShardSpec
from omnifeed.loader.index import _ray_build as _index_ray
from omnifeed.loader.index._sample_index import ROW_SCHEMA


class Ref:
    """A hashable object reference, as Ray's are."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args


class FakeRay:
    """Runs "tasks" when they are waited on, latest first; records how many were in flight at most."""

    class exceptions:  # noqa: N801  (the shape of ray.exceptions)
        RayError = RuntimeError

    def __init__(self, cpus: int) -> None:
        self.cpus, self.in_flight, self.most = cpus, [], 0

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": float(self.cpus)}

    def remote(self, **_: Any) -> Any:
        def wrap(fn: Any) -> Any:
            fake = self

            class Task:
                @staticmethod
                def remote(*args: Any) -> Any:
                    ref = Ref(fn, args)
                    fake.in_flight.append(ref)
                    fake.most = max(fake.most, len(fake.in_flight))
                    return ref

            return Task

        return wrap

    def wait(self, refs: list[Any], num_returns: int) -> tuple[list[Any], list[Any]]:
        done = refs[-1]
        self.in_flight.remove(done)
        return [done], [r for r in refs if r is not done]

    def get(self, ref: Ref) -> Any:
        return ref.fn(*ref.args)


@pytest.mark.parametrize(("shards", "per_task", "cpus"), [(1, None, 1), (10, 1, 1), (37, 3, 2), (200, None, 3)])
def test_every_shard_is_scanned_once_with_few_tasks_in_flight(
    monkeypatch: pytest.MonkeyPatch, shards: int, per_task: int | None, cpus: int
) -> None:
    monkeypatch.setattr(_index_ray, "scan_job", lambda job: (job[0], ROW_SCHEMA.empty_table(), 1, None))
    fake = FakeRay(cpus)
    specs = [ShardSpec(url=f"s{i}.tar", kind="tar") for i in range(shards)]
    results = list(_index_ray._scan_on_ray(fake, per_task, specs, IndexConfig()))
    assert sorted(r[0] for r in results) == list(range(shards))
    assert all(isinstance(r[1], pa.Table) for r in results)
    assert fake.most <= 2 * cpus and not fake.in_flight
