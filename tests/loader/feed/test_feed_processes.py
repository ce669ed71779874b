"""Every modality decoded in worker processes through shared memory: the same bytes as threads, in plan order, after
a resume, within the buffers, with the memory reused once batches are collated."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
from decoded_values import same_values

from omnifeed.loader import Feed, FeedConfig, IndexConfig, PlanConfig, PoolConfig, SampleIndex, build_index
from omnifeed.loader.feed._collate import collate

MEDIA = ("image", "video", "audio", "text")


@pytest.fixture(scope="module")
def index(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    out = tmp_path_factory.mktemp("feed-processes") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    return SampleIndex(out)


def config(processes: int, shared_memory: bool = True) -> FeedConfig:
    pools = {
        m: PoolConfig(workers=2 * processes or 1, processes=processes, shared_memory=shared_memory, buffer_samples=8)
        for m in MEDIA
    }
    return FeedConfig(plan=PlanConfig(seed=5, batch_size=4), pools=pools, shared_workers=0)


def numpy_batches(feed: Feed, count: int | None = None) -> list[dict[str, Any]]:
    """Collated numpy batches (what the service writes into its segments), ``count`` of them or the epoch."""
    out: list[dict[str, Any]] = []
    while count is None or len(out) < count:
        if count is None and feed.position.accum_done == 0 and out and feed.epoch > out[0]["__info__"]["epoch"]:
            break
        taken = feed.take()
        out.append(collate(taken.samples, taken.keys, taken.info))
    return out


def scratch_arenas(feed: Feed) -> list[Any]:
    executors = feed._reader.decoders._executors  # noqa: SLF001  the test looks inside
    return [w.scratch for e in executors.values() for w in e._idle if w.scratch is not None]  # noqa: SLF001


def test_processes_through_shared_memory_deliver_the_bytes_threads_do(index: SampleIndex) -> None:
    with Feed(index, config(0)) as threads:
        expected = numpy_batches(threads)
    with Feed(index, config(2)) as processes:
        got = numpy_batches(processes)
        arenas = scratch_arenas(processes)
        assert arenas and sum(a.fallbacks for a in arenas) == 0  # every array came through shared memory
    gc.collect()
    assert all(a.free_bytes() == a.size for a in arenas)  # collated batches and a closed feed hold none of it
    assert [b["__key__"] for b in got] == [b["__key__"] for b in expected]
    assert all(
        same_values({k: v for k, v in g.items() if k != "__info__"}, {k: v for k, v in e.items() if k != "__info__"})
        for g, e in zip(got, expected)
    )


def test_a_resume_from_processes_is_byte_identical(index: SampleIndex) -> None:
    with Feed(index, config(2)) as feed:
        numpy_batches(feed, 3)
        state = feed.state_dict()
        rest = numpy_batches(feed, 4)
    with Feed(index, config(0)) as resumed:
        resumed.load_state_dict(state)
        again = numpy_batches(resumed, 4)
    assert all(same_values(a, b) for a, b in zip(rest, again))


def test_the_pipe_path_still_delivers_the_same_bytes(index: SampleIndex) -> None:
    with Feed(index, config(0)) as threads:
        expected = numpy_batches(threads, 5)
    with Feed(index, config(1, shared_memory=False)) as pipe:
        got = numpy_batches(pipe, 5)
        assert scratch_arenas(pipe) == []
    assert all(same_values(a, b) for a, b in zip(got, expected))
