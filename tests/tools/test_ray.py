"""Ray scale-out on a local one-node cluster started here: precache and index give what local processes give."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from omnifeed.cache import NvmeTier, NvmeTierConfig
from omnifeed.loader import DecodeConfig, IndexConfig, SampleIndex, build_index
from omnifeed.loader.decode._config import ImageDecodeConfig
from omnifeed.loader.index._ray_build import build_index_ray
from omnifeed.tools._precache import PrecacheJob
from omnifeed.tools._precache_run import precache_local
from omnifeed.tools._ray import precache_on_ray

ray = pytest.importorskip("ray")

OMNIFEED = str(Path(sys.executable).with_name("omnifeed"))
CAPACITY = 256 * 2**20


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster (one node, 2 CPUs) this process is connected to; its address."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def index(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    out = tmp_path_factory.mktemp("ray") / "index"
    build_index([str(s) for s in demo_shards], out, IndexConfig(partitions=3, workers=1), progress=False)
    return SampleIndex(out)


def content(path: Path) -> dict[bytes, bytes]:
    with NvmeTier(NvmeTierConfig(path=str(path), capacity_bytes=CAPACITY)) as tier:
        return {key: tier.get(key) or b"" for key in tier.keys()}


@pytest.mark.parametrize("entries", ["raw", "decoded"])
def test_precache_on_ray_writes_the_entries_local_processes_write(
    cluster: str, index: SampleIndex, tmp_path: Path, entries: str
) -> None:
    def job(name: str) -> PrecacheJob:
        return PrecacheJob(
            index=str(index.path),
            nvme=NvmeTierConfig(path=str(tmp_path / name), capacity_bytes=CAPACITY),
            entries=entries,
            decode=DecodeConfig(image=ImageDecodeConfig(resize="fixed", size=32)),
        )

    local = precache_local(job("local"), [0, 1, 2], workers=1, progress=False)
    on_ray = precache_on_ray(job("ray"), [0, 1, 2], progress=False)  # this process's connection
    assert on_ray.nodes == 1 and on_ray.counts == local.counts and local.counts.failed == 0
    assert content(tmp_path / "ray") == content(tmp_path / "local")
    assert len(content(tmp_path / "ray")) == local.counts.cached > 0


def test_index_on_ray_is_the_index_local_processes_build(cluster: str, demo_shards: list[Path], tmp_path: Path) -> None:
    config = IndexConfig(partitions=3, workers=1)
    sources = [str(s) for s in demo_shards]
    local = build_index(sources, tmp_path / "local", config, progress=False)
    on_ray = build_index_ray(sources, tmp_path / "ray", config, progress=False, shards_per_task=1)
    assert on_ray.fingerprint == local.fingerprint and on_ray.num_samples == local.num_samples
    for name in ["manifest.json", "shards.parquet"]:
        assert (tmp_path / "ray" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    for p in range(3):
        assert pq.read_table(tmp_path / "ray" / f"part-{p:05d}.parquet").equals(
            pq.read_table(tmp_path / "local" / f"part-{p:05d}.parquet")
        )
    assert np.array_equal(np.load(tmp_path / "ray" / "by_shard.npy"), np.load(tmp_path / "local" / "by_shard.npy"))


def test_the_commands_join_a_ray_cluster_by_address(
    cluster: str, demo_shards: list[Path], index: SampleIndex, tmp_path: Path
) -> None:
    def omnifeed(*args: str) -> dict:
        result = subprocess.run(
            [OMNIFEED, *args, "--no-progress", "--ray", cluster], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.splitlines()[-1])

    built = omnifeed("index", *map(str, demo_shards), "--out", str(tmp_path / "index"), "--partitions", "3", "--json")
    assert built["fingerprint"] == index.fingerprint
    cached = omnifeed(
        "precache", str(tmp_path / "index"), "--cache", str(tmp_path / "nvme"), "--capacity", str(CAPACITY)
    )
    assert cached["nodes"] == 1 and cached["failed"] == 0 and cached["cached"] == len(content(tmp_path / "nvme")) > 0
