"""Shared fixtures: a small built-in demo dataset, generated once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnifeed.loader import IndexConfig, build_index
from omnifeed.tools._demo_data import (
    DemoDatasetSpec,
    DemoSample,
    demo_samples,
    write_folder,
    write_parquet,
    write_webdataset,
)


@pytest.fixture(scope="session")
def demo_spec() -> DemoDatasetSpec:
    """A small demo dataset: 48 samples of every kind, 3 tar shards, 3 Parquet row groups."""
    return DemoDatasetSpec(num_samples=48, num_shards=3, seed=0, row_group_size=16)


@pytest.fixture(scope="session")
def demo_truth(demo_spec: DemoDatasetSpec) -> list[DemoSample]:
    """The generated samples of ``demo_spec`` with their true lengths, in key order."""
    return demo_samples(demo_spec)


@pytest.fixture(scope="session")
def demo_shards(
    demo_spec: DemoDatasetSpec,
    demo_truth: list[DemoSample],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[Path]:
    """``demo_spec`` as WebDataset tar shards (``shard-0000.tar`` ...), in shard order."""
    return write_webdataset(tmp_path_factory.mktemp("demo-wds"), demo_spec, samples=demo_truth)


@pytest.fixture(scope="session")
def demo_parquet(
    demo_spec: DemoDatasetSpec,
    demo_truth: list[DemoSample],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """``demo_spec`` as one Parquet file with several row groups."""
    out = tmp_path_factory.mktemp("demo-parquet") / "demo.parquet"
    return write_parquet(out, demo_spec, samples=demo_truth)


@pytest.fixture(scope="session")
def demo_folder(
    demo_spec: DemoDatasetSpec,
    demo_truth: list[DemoSample],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """``demo_spec`` as a folder tree ``part-NN/sample-XXXXXX.<field>``; the root folder."""
    return write_folder(tmp_path_factory.mktemp("demo-folder"), demo_spec, samples=demo_truth)


@pytest.fixture(scope="session")
def index_dir(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo shards indexed once for the session (read-only: a test that damages an index builds its own)."""
    out = tmp_path_factory.mktemp("demo-index") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    return out
