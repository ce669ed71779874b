"""A decode worker process that dies (kill -9, out of memory) costs a retry, never a sample (found by
`omnifeed chaos`)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from omnifeed.loader import Feed, FeedConfig, IndexConfig, PlanConfig, build_index
from omnifeed.loader.feed._config import PoolConfig


@pytest.fixture(scope="module")
def index_dir(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("worker-crash") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    return out


def decode_workers() -> list[psutil.Process]:
    """This process's decode workers: the children of its multiprocessing fork server."""
    me = psutil.Process(os.getpid())
    servers = [p for p in me.children() if any("forkserver" in part for part in p.cmdline())]
    return [worker for server in servers for worker in server.children()]


def test_a_killed_decode_worker_is_replaced_and_its_samples_decoded_again(index_dir: Path) -> None:
    config = FeedConfig(plan=PlanConfig(seed=1, batch_size=4), pools={"image": PoolConfig(workers=2, processes=1)})
    with Feed(index_dir, FeedConfig(plan=config.plan)) as reference:
        expected = [batch["__key__"] for batch in reference]
    with Feed(index_dir, config) as feed:
        batches = iter(feed)
        seen = [next(batches)]
        workers = decode_workers()
        assert workers, "the image decode worker process runs"
        for worker in workers:
            worker.kill()
        seen += list(batches)
        bad = feed.metrics()["modalities"]["image"]["bad"]
    assert [batch["__key__"] for batch in seen] == expected
    assert [batch["__info__"]["replaced"] for batch in seen if batch["__info__"]["replaced"]] == []
    assert sum(bad.values()) == 0, bad
    assert not decode_workers() or all(w.pid not in {v.pid for v in workers} for w in decode_workers())
