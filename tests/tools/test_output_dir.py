"""Commands never delete what omnifeed did not create: a foreign non-empty --out is refused, its files untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnifeed.tools._output_dir import MARKER, ForeignDirectoryError, check_cache_dir, prepare_output_dir

OMNIFEED = str(Path(sys.executable).with_name("omnifeed"))


def project(folder: Path) -> Path:
    """A user's folder with work in it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text("print('my training script')\n", encoding="utf-8")
    (folder / "notes").mkdir(exist_ok=True)
    (folder / "notes" / "todo.txt").write_text("keep me\n", encoding="utf-8")
    return folder


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "command",
    [
        ["demo", "--out", "."],
        ["chaos", "--minutes", "0.1", "--quick", "--out", "."],
        ["bench", "--quick", "--out", "."],
    ],
)
def test_a_command_refuses_a_folder_it_did_not_create(tmp_path: Path, command: list[str]) -> None:
    folder = project(tmp_path / "myproject")
    before = files(folder)
    result = subprocess.run([OMNIFEED, *command], cwd=folder, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "not empty and was not written by omnifeed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert files(folder) == before


def test_own_earlier_output_is_replaced_without_asking(tmp_path: Path) -> None:
    out = prepare_output_dir(tmp_path / "out", "demo")
    (out / "old-result.json").write_text("{}", encoding="utf-8")
    prepare_output_dir(out, "demo")
    assert sorted(p.name for p in out.iterdir()) == [MARKER]


def test_an_empty_folder_is_taken_and_a_file_or_link_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert (prepare_output_dir(tmp_path / "empty", "chaos") / MARKER).is_file()
    (tmp_path / "file").write_text("x", encoding="utf-8")
    with pytest.raises(ForeignDirectoryError):
        prepare_output_dir(tmp_path / "file", "demo")
    target = project(tmp_path / "target")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(ForeignDirectoryError):
        prepare_output_dir(tmp_path / "link", "demo")
    assert (target / "train.py").is_file()


def test_precache_refuses_a_cache_folder_holding_other_files(tmp_path: Path) -> None:
    folder = project(tmp_path / "cache")
    with pytest.raises(ForeignDirectoryError, match="not an omnifeed cache"):
        check_cache_dir(folder)
    tier = tmp_path / "tier"
    tier.mkdir()
    (tier / "data.mdb").write_bytes(b"")
    (tier / "lock.mdb").write_bytes(b"")
    (tier / ".secret-123-0a1b2c3d").write_bytes(b"")  # a secret being written (no O_TMPFILE)
    check_cache_dir(tier)  # an earlier omnifeed cache: fine
