"""`omnifeed cache list` / `remove` against real RAM tier segments in /dev/shm and a real NVMe tier.

``--all-mine`` would also remove the segments of everything else this user runs on the machine
(other test runs, a warm cache of a real job), so it runs against a private segment folder;
the other commands use /dev/shm itself, with names no one else uses.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnifeed.cache import NvmeTier, NvmeTierConfig, RamTier, RamTierConfig, _ram_layout, entry_key
from omnifeed.tools._cli import main


def fill(name: str, entries: int) -> Path:
    """A real segment called ``name`` holding ``entries`` entries, detached; its path."""
    with RamTier(RamTierConfig(name=name, capacity_bytes=256 * 1024)) as tier:
        for i in range(entries):
            assert tier.put(entry_key("t", str(i), "f", "raw"), b"x" * 100)
        return tier.path


@pytest.fixture
def name() -> Iterator[str]:
    name = f"test-cli-{uuid.uuid4().hex[:12]}"
    yield name
    RamTier.remove(name)


def listed(capsys: pytest.CaptureFixture[str], *flags: str) -> list[dict]:
    assert main(["cache", "list", "--json", *flags]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_list_shows_a_segment_with_owner_size_entries_and_last_use(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = fill(name, 3)
    (row,) = [row for row in listed(capsys) if row["name"] == name]
    assert row["path"] == str(path) and row["entries"] == 3 and row["state"] == "ready"
    assert row["size_bytes"] == path.stat().st_size and row["capacity_bytes"] == 256 * 1024 and row["mapped_by"] == []
    assert row["owner"] and row["last_used"].startswith(str(__import__("time").localtime().tm_year))
    assert main(["cache", "list"]) == 0
    assert name in capsys.readouterr().out


def test_remove_removes_the_segment_and_its_lock_file(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = fill(name, 1)
    assert main(["cache", "remove", name]) == 0
    assert capsys.readouterr().out.startswith(f"removed {path}")
    assert not path.exists() and not path.with_name(path.name + ".lock").exists()
    assert name not in [row["name"] for row in listed(capsys)]


def test_a_file_that_only_looks_like_a_segment_is_never_listed_or_removed(capsys: pytest.CaptureFixture[str]) -> None:
    lookalike = Path("/dev/shm") / f"omnifeed-ram-test-{uuid.uuid4().hex[:12]}"
    lookalike.write_bytes(b"not an omnifeed tier" * 300)
    try:
        assert lookalike.name.removeprefix("omnifeed-ram-") not in [row["name"] for row in listed(capsys)]
        assert main(["cache", "remove", lookalike.name]) == 1
        assert "no omnifeed RAM tier segment" in capsys.readouterr().err and lookalike.exists()
    finally:
        lookalike.unlink()


def test_all_mine_removes_every_segment_of_the_user_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_ram_layout, "_SHM", tmp_path)
    mine = [fill("a", 1), fill("b", 2)]
    foreign = [tmp_path / "omnifeed-ram-c", tmp_path / "other-program-segment", tmp_path / "omnifeed-ram-d.lock"]
    foreign[0].write_bytes(os.urandom(8192))
    foreign[1].write_bytes(b"\0" * 8192)
    (tmp_path / "elsewhere").write_bytes(b"")
    foreign[2].symlink_to(tmp_path / "elsewhere")
    assert main(["cache", "remove", "--all-mine"]) == 0
    assert not any(path.exists() for path in mine) and all(path.exists() or path.is_symlink() for path in foreign)
    assert main(["cache", "remove", "--all-mine"]) == 0
    assert "no omnifeed RAM tier segments of yours" in capsys.readouterr().out


def test_a_segment_in_use_is_kept_unless_forced(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = fill(name, 1)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from omnifeed.cache import RamTier, RamTierConfig; "
            f"t = RamTier(RamTierConfig(name={name!r}, capacity_bytes=256 * 1024)); print('ready', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        (row,) = [row for row in listed(capsys) if row["name"] == name]
        assert row["mapped_by"] == [holder.pid]
        assert main(["cache", "remove", name]) == 1
        assert f"in use by process(es) {holder.pid}" in capsys.readouterr().err and path.exists()
        assert main(["cache", "remove", name, "--force"]) == 0 and not path.exists()
    finally:
        holder.communicate("", timeout=60)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_another_users_segment_is_refused(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = fill(name, 1)
    os.chown(path, 54321, -1)
    assert main(["cache", "remove", name]) == 1
    assert "belongs to 54321: only its owner may remove it" in capsys.readouterr().err and path.exists()


def test_list_nvme_shows_the_tiers_under_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with NvmeTier(NvmeTierConfig(path=str(tmp_path / "job" / "tier"), capacity_bytes=2**20)) as tier:
        for i in range(5):
            assert tier.put(entry_key("t", str(i), "f", "raw"), b"y" * 1000)
    (tmp_path / "unrelated").mkdir()
    rows = [row for row in listed(capsys, "--nvme", str(tmp_path)) if row["tier"] == "nvme"]
    assert [(row["path"], row["entries"], row["state"]) for row in rows] == [
        (str(tmp_path / "job" / "tier"), 5, "ready")
    ]
    assert rows[0]["bytes_used"] > 5000 and rows[0]["size_bytes"] > 0


def test_the_ram_tier_logs_its_segment_and_how_to_remove_it(name: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="omnifeed.cache._ram"):
        fill(name, 0)
    assert f"remove it with `omnifeed cache remove {name}`" in caplog.text and f"omnifeed-ram-{name}" in caplog.text


@pytest.mark.timeout(60)
def test_list_nvme_never_opens_a_fifo_or_another_users_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Another user can plant either under a shared folder: a FIFO would block the listing's open
    # forever, and LMDB trusts the structure of the file it maps.
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "data.mdb")
    with NvmeTier(NvmeTierConfig(path=str(tmp_path / "theirs"), capacity_bytes=2**20)) as tier:
        assert tier.put(entry_key("t", "0", "f", "raw"), b"y" * 1000)
    rows = [row for row in listed(capsys, "--nvme", str(tmp_path)) if row["tier"] == "nvme"]
    assert [row["path"] for row in rows] == [str(tmp_path / "theirs")] and rows[0]["state"] == "ready"
    if os.geteuid() != 0:
        return  # handing the file to another uid needs root
    os.chown(tmp_path / "theirs" / "data.mdb", 54321, -1)
    rows = [row for row in listed(capsys, "--nvme", str(tmp_path)) if row["tier"] == "nvme"]
    assert [(row["state"], row["entries"]) for row in rows] == [("another user's (not opened)", None)]
    assert "54321" in rows[0]["owner"]
