"""`omnifeed precache`: a run killed with SIGKILL resumes without refetching, a feed after it needs no
source (raw and decoded entries), failures are named and counted, flags give clear errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from range_http import RangeServer
from shm_semaphores import semaphore_inodes, shm_inodes

from omnifeed.cache import CacheConfig, NvmeTier, NvmeTierConfig
from omnifeed.loader import DecodeConfig, Feed, FeedConfig, IndexConfig, PlanConfig, SampleIndex, build_index
from omnifeed.loader.feed._field_source import FieldSource
from omnifeed.loader.feed._pipeline import fields_to_decode
from omnifeed.tools._cli import main
from omnifeed.tools._index_commands import parse_bytes as _parse_bytes
from omnifeed.tools._precache import partition_bytes, partition_span

pytest.importorskip("aiohttp")  # fsspec's HTTP filesystem

OMNIFEED = str(Path(sys.executable).with_name("omnifeed"))
CAPACITY = 256 * 2**20


@pytest.fixture(scope="module")
def http(demo_shards: list[Path]) -> Iterator[RangeServer]:
    server = RangeServer(demo_shards[0].parent).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http_index(http: RangeServer, demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    out = tmp_path_factory.mktemp("precache") / "index"
    build_index(
        [f"{http.url}/{s.name}" for s in demo_shards], out, IndexConfig(partitions=3, workers=1), progress=False
    )
    return SampleIndex(out)


@pytest.fixture
def server(http: RangeServer) -> Iterator[RangeServer]:
    http.reset()
    yield http
    http.reset()


def expected(index: SampleIndex, root: Path) -> dict[bytes, bytes]:
    """Every raw entry the feed reads: key -> the field's bytes, read from the shard files in ``root``."""
    source = FieldSource(CacheConfig(), index.fingerprint, DecodeConfig())
    out = {}
    for sample in index.samples(range(len(index))):
        data = (root / sample.shard.url.rsplit("/", 1)[-1]).read_bytes()
        for _, field in fields_to_decode(sample):
            out[source.raw_key(sample, field)] = data[field.offset : field.offset + field.size]
    source.close()
    return out


def held(path: Path) -> dict[bytes, bytes]:
    with NvmeTier(NvmeTierConfig(path=str(path), capacity_bytes=CAPACITY)) as tier:
        return {key: tier.get(key) or b"" for key in tier.keys()}


def precache(*args: str) -> dict[str, Any]:
    result = subprocess.run([OMNIFEED, "precache", *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout), "stderr": result.stderr}


def test_a_precache_killed_with_sigkill_resumes_without_refetching_what_it_cached(
    server: RangeServer, http_index: SampleIndex, demo_shards: list[Path], tmp_path: Path
) -> None:
    truth = expected(http_index, demo_shards[0].parent)
    start, stop = partition_span(http_index, 0)
    first_partition = sum(len(fields_to_decode(s)) for s in http_index.samples(range(start, stop)))
    server.reset(allow=first_partition + 3)  # partition 0 completes, then reads of partition 1 hang
    cache = tmp_path / "nvme"
    args = [str(http_index.path), "--cache", str(cache), "--capacity", str(CAPACITY), "--workers", "1"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            [OMNIFEED, "precache", *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 240  # a hang guard, not a speed check
    while server.waiting == 0 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, (tmp_path / "first.log").read_text()
    os.killpg(first.pid, signal.SIGKILL)  # the whole job, as a scheduler kills it
    assert first.wait() == -signal.SIGKILL
    kept = held(cache)
    assert 0 < len(kept) < len(truth) and all(truth[k] == v for k, v in kept.items())

    server.reset()
    second = precache(*args)
    assert (second["present"], second["cached"], second["failed"]) == (len(kept), len(truth) - len(kept), 0)
    assert server.served == len(truth) - len(kept), "only what was not cached is read again"
    assert held(cache) == truth
    assert "B/s" in second["stderr"]  # the progress bar: bytes per second and ETA


def test_sigterm_stops_a_precache_as_ctrl_c_with_exit_143_and_no_worker_or_semaphore_left(
    server: RangeServer, http_index: SampleIndex, tmp_path: Path
) -> None:
    server.reset(allow=0)  # every read waits: both workers are held mid-partition
    args = [str(http_index.path), "--cache", str(tmp_path / "nvme"), "--capacity", str(CAPACITY), "--workers", "2"]
    job = subprocess.Popen([OMNIFEED, "precache", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240  # a hang guard, not a speed check
        while server.waiting < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.poll() is None, job.communicate()
        descendants = psutil.Process(job.pid).children(recursive=True)
        semaphores = semaphore_inodes(job.pid)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    finally:
        server.reset()
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143, stderr
    assert "omnifeed: terminated (SIGTERM): stopped; the entries cached so far are kept" in stderr
    _, alive = psutil.wait_procs(descendants, timeout=60)
    assert alive == [] and semaphores and not semaphores & shm_inodes()


def test_a_feed_after_precache_reads_nothing_from_the_unavailable_source(
    server: RangeServer, http_index: SampleIndex, demo_shards: list[Path], tmp_path: Path
) -> None:
    cache = tmp_path / "nvme"
    summary = precache(str(http_index.path), "--cache", str(cache), "--capacity", str(CAPACITY), "--workers", "2")
    truth = expected(http_index, demo_shards[0].parent)
    assert (summary["cached"], summary["failed"], summary["not_held"]) == (len(truth), 0, 0)
    assert held(cache) == truth
    server.reset(down=True)
    config = FeedConfig(
        plan=PlanConfig(seed=3, batch_size=4),
        cache=CacheConfig(nvme=NvmeTierConfig(path=str(cache), capacity_bytes=CAPACITY)),
    )
    with Feed(http_index, config) as feed:
        batches = list(iter(feed))
        metrics = feed.metrics()["cache"]
    assert sorted(k for b in batches for k in b["__key__"]) == sorted(http_index.keys(range(len(http_index))))
    assert all(not b["__info__"]["replaced"] for b in batches)
    assert server.requests == 0 and metrics["remote"]["reads"] == 0 and metrics["nvme"]["misses"] == 0
    assert metrics["nvme"]["hits"] >= len(truth)  # (the feed also reads ahead into the next epoch)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture
def local_index(demo_shards: list[Path], tmp_path: Path) -> tuple[SampleIndex, Path]:
    """An index over a private copy of the demo shards, which the test may move away or break."""
    source = tmp_path / "source"
    source.mkdir()
    for shard in demo_shards:
        shutil.copy(shard, source / shard.name)
    build_index(
        [str(source / s.name) for s in demo_shards],
        tmp_path / "index",
        IndexConfig(partitions=3, workers=1),
        progress=False,
    )
    return SampleIndex(tmp_path / "index"), source


def test_decoded_entries_give_the_feed_identical_batches_with_the_shards_moved_away(
    local_index: tuple[SampleIndex, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index, source = local_index
    feed_yaml = tmp_path / "feed.yaml"
    feed_yaml.write_text(
        f"plan: {{seed: 5, batch_size: 4}}\ndecode: {{image: {{resize: fixed, size: 48}}}}\n"
        f"cache: {{entries: decoded, nvme: {{path: '{tmp_path / 'nvme'}', capacity_bytes: {CAPACITY}}}}}\n"
    )
    config = FeedConfig.from_yaml(feed_yaml)
    with Feed(index, config.model_copy(update={"cache": CacheConfig()})) as reference:
        wanted = list(iter(reference))
    assert main(["precache", str(index.path), "--config", str(feed_yaml), "--workers", "1", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["entries"] == "decoded" and summary["failed"] == 0 and summary["cached"] > 0
    source.rename(tmp_path / "gone")
    with Feed(index, config) as feed:
        got = list(iter(feed))
        metrics = feed.metrics()["cache"]
    assert metrics["remote"]["reads"] == 0 and metrics["nvme"]["misses"] == 0
    assert same(got, wanted)


def test_a_missing_shard_is_named_and_counted_and_the_rest_is_cached(
    local_index: tuple[SampleIndex, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index, source = local_index
    truth = expected(index, source)
    (source / "shard-0001.tar").unlink()
    lost = [s for s in index.samples(range(len(index))) if s.shard.url.endswith("shard-0001.tar")]
    lost_entries = sum(len(fields_to_decode(s)) for s in lost)
    args = ["precache", str(index.path), "--capacity", str(CAPACITY), "--workers", "1", "--no-progress"]
    assert main([*args, "--cache", str(tmp_path / "nvme")]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert (summary["failed"], summary["cached"]) == (lost_entries, len(truth) - lost_entries)
    assert f"not cached: sample {lost[0].key!r}" in err and "shard-0001.tar" in err
    for shard in source.iterdir():
        shard.unlink()
    assert main([*args, "--cache", str(tmp_path / "other")]) == 1  # nothing readable: the job could not run
    assert "no entry could be read" in capsys.readouterr().err


def test_a_tier_too_small_for_the_data_is_reported_and_keeps_what_it_holds(
    local_index: tuple[SampleIndex, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index, source = local_index
    total = len(expected(index, source))
    args = [
        "precache",
        str(index.path),
        "--cache",
        str(tmp_path / "small"),
        "--capacity",
        "1M",
        "--workers",
        "1",
        "--no-progress",
    ]
    assert main(args) == 0
    first, err = capsys.readouterr()
    summary = json.loads(first)
    assert summary["not_held"] > 0 and summary["cached"] + summary["not_held"] == total
    assert "raise --capacity" in err
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["present"] == summary["cached"] and again["cached"] == 0


def test_partition_bytes_sum_the_fields_the_feed_reads(http_index: SampleIndex) -> None:
    for partition in range(len(http_index.manifest["partitions"])):
        start, stop = partition_span(http_index, partition)
        samples = http_index.samples(range(start, stop))
        assert partition_bytes(http_index, partition) == sum(f.size for s in samples for _, f in fields_to_decode(s))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1000", 1000),
        ("64M", 64 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5G", 3 * 2**29),
        ("500GB", 500 * 10**9),
        ("7 k", 7 * 1024),
    ],
)
def test_capacities_read_with_units(text: str, value: int) -> None:
    assert _parse_bytes(text) == value


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cache", "{tmp}/c", "--partitions", "1,5"], "5 is outside the index's 3 partitions (0-2)"),
        (["--cache", "{tmp}/c", "--partitions", "a-b"], "give numbers and ranges"),
        ([], "no cache directory: pass --cache DIR"),
        (["--cache", "{tmp}/c", "--capacity", "lots"], "--capacity 'lots'"),
        (["--cache", "{tmp}/c", "--decode", "--config", "{tmp}/raw.yaml"], "set cache.entries: decoded there"),
        (["--cache", "{tmp}/c", "--ray", "some/dir"], "not a Ray address"),
        (["--cache", "{tmp}/c", "--ray", "--workers", "2"], "--workers sets local processes"),
    ],
)
def test_bad_flags_exit_1_with_a_one_line_reason(
    http_index: SampleIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    (tmp_path / "raw.yaml").write_text("cache: {entries: raw}\n")
    assert main(["precache", str(http_index.path), *(f.format(tmp=tmp_path) for f in flags)]) == 1
    err = capsys.readouterr().err
    assert message in err and err.startswith("omnifeed: error:") and err.count("\n") == 1


def test_ray_flags_without_ray_say_how_to_install_it(
    http_index: SampleIndex,
    demo_shards: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if not installed
    assert main(["precache", str(http_index.path), "--cache", str(tmp_path / "c"), "--ray"]) == 1
    assert "pip install 'omnifeed[ray]'" in capsys.readouterr().err
    assert main(["index", str(demo_shards[0]), "--out", str(tmp_path / "i"), "--ray", "--no-progress"]) == 1
    assert "pip install 'omnifeed[ray]'" in capsys.readouterr().err


def test_a_ray_address_nothing_listens_on_fails_fast_naming_it(
    http_index: SampleIndex, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray")
    assert main(["precache", str(http_index.path), "--cache", str(tmp_path / "c"), "--ray", "127.0.0.1:1"]) == 1
    assert "no Ray cluster answers at 127.0.0.1:1" in capsys.readouterr().err
