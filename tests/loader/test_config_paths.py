"""Every relative path in a YAML config is relative to the file's folder, whatever the working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from omnifeed.loader import FeedConfig
from omnifeed.loader.service._config import ServiceConfig


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory that is not the config file's folder."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    previous = os.getcwd()
    os.chdir(cwd)
    yield cwd
    os.chdir(previous)


def write(folder: Path, name: str, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


@pytest.mark.parametrize("field", ["index", "audit_log", "socket"])
def test_service_paths_are_relative_to_the_file(tmp_path: Path, elsewhere: Path, field: str) -> None:
    data = {"index": "idx", field: "sub/thing"}
    config = ServiceConfig.from_yaml(write(tmp_path / "conf", "service.yaml", data))
    assert getattr(config, field) == str(tmp_path / "conf" / "sub" / "thing")


def test_the_service_files_nvme_path_is_relative_to_the_file(tmp_path: Path, elsewhere: Path) -> None:
    data = {"index": "idx", "feed": {"cache": {"nvme": {"path": "cache", "capacity_bytes": 2**20}}}}
    config = ServiceConfig.from_yaml(write(tmp_path / "conf", "service.yaml", data))
    assert config.feed.cache.nvme is not None
    assert config.feed.cache.nvme.path == str(tmp_path / "conf" / "cache")


def test_a_feed_files_nvme_path_is_relative_to_the_file(tmp_path: Path, elsewhere: Path) -> None:
    data = {"cache": {"nvme": {"path": "../nvme", "capacity_bytes": 2**20}}}
    config = FeedConfig.from_yaml(write(tmp_path / "a" / "b", "feed.yaml", data))
    assert config.cache.nvme is not None
    assert Path(config.cache.nvme.path).resolve() == (tmp_path / "a" / "nvme").resolve()


def test_absolute_paths_and_urls_are_kept(tmp_path: Path, elsewhere: Path) -> None:
    data = {"index": "s3://bucket/index", "audit_log": str(tmp_path / "audit.jsonl"), "socket": "~/feed.sock"}
    config = ServiceConfig.from_yaml(write(tmp_path / "conf", "service.yaml", data))
    assert config.index == "s3://bucket/index"
    assert config.audit_log == str(tmp_path / "audit.jsonl")
    assert config.socket == str(Path("~/feed.sock").expanduser())
