"""The index's output folder: replaced only when empty or an omnifeed index and nothing else, refused before a
shard is scanned otherwise, and never left half-written or with omnifeed's temporary folders beside it."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnifeed.loader import IndexConfig, OmnifeedError, SampleIndex, SourceError, build_index

CONFIG = IndexConfig(workers=1)


def shard(path: Path, keys: list[str]) -> str:
    """A tar shard of one text field per key."""
    with tarfile.open(path, "w") as tar:
        for key in keys:
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = len(key)
            tar.addfile(info, io.BytesIO(key.encode()))
    return str(path)


def build(sources: list[str], out: Path) -> SampleIndex:
    build_index(sources, out, CONFIG, progress=False)
    return SampleIndex(out)


def leftovers(parent: Path) -> list[str]:
    """Omnifeed's temporary folders left beside an index (a build in progress, an old index moved aside)."""
    return sorted(p.name for p in parent.iterdir() if ".building-" in p.name or ".old-" in p.name)


@pytest.mark.parametrize("existing", ["absent", "empty"])
def test_an_absent_or_empty_folder_becomes_the_index(tmp_path: Path, existing: str) -> None:
    out = tmp_path / "index"
    if existing == "empty":
        out.mkdir()
    assert build([shard(tmp_path / "a.tar", ["a1", "a2"])], out).num_samples == 2
    assert leftovers(tmp_path) == []


def test_an_index_is_replaced_by_the_new_one_as_a_whole(tmp_path: Path) -> None:
    out = tmp_path / "index"
    build([shard(tmp_path / "a.tar", ["a1", "a2", "a3"])], out)
    build_index([shard(tmp_path / "b.tar", ["b1"])], out, CONFIG.model_copy(update={"partitions": 1}), progress=False)
    index = SampleIndex(out)
    assert index.keys(range(index.num_samples)) == ["b1"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("part-")) == [
        "part-00000.arrow",
        "part-00000.parquet",
    ]
    assert leftovers(tmp_path) == []


def test_a_folder_of_other_files_is_refused_before_anything_is_scanned(tmp_path: Path) -> None:
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    scanned: list[str] = []

    def scanner(shards: list, config: IndexConfig) -> Iterator:
        scanned.extend(s.url for s in shards)
        return iter(())

    with pytest.raises(OmnifeedError, match=r"results: not empty and not an omnifeed index .* choose another --out"):
        build_index([shard(tmp_path / "a.tar", ["a1"])], out, CONFIG, progress=False, scanner=scanner)
    assert scanned == [] and [p.name for p in out.iterdir()] == ["notes.txt"] and leftovers(tmp_path) == []


def test_an_index_with_files_omnifeed_did_not_write_is_refused_naming_them(tmp_path: Path) -> None:
    out = tmp_path / "index"
    before = build([shard(tmp_path / "a.tar", ["a1", "a2"])], out).fingerprint
    (out / "README.md").write_text("about this index")
    (out / "part-00000.parquet.bak").write_bytes(b"")
    with pytest.raises(OmnifeedError, match=r"files omnifeed did not write \(README\.md, part-00000\.parquet\.bak\)"):
        build_index([shard(tmp_path / "b.tar", ["b1"])], out, CONFIG, progress=False)
    assert SampleIndex(out).fingerprint == before and (out / "README.md").exists()


def test_a_manifest_of_someone_else_does_not_make_a_folder_an_index(tmp_path: Path) -> None:
    out = tmp_path / "index"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"format": "another-tool/1"}))
    with pytest.raises(OmnifeedError, match="not an omnifeed index"):
        build_index([shard(tmp_path / "a.tar", ["a1"])], out, CONFIG, progress=False)
    assert json.loads((out / "manifest.json").read_text()) == {"format": "another-tool/1"}


@pytest.mark.parametrize("kind", ["link", "file"])
def test_a_link_or_a_file_at_the_output_path_is_refused(tmp_path: Path, kind: str) -> None:
    out, target = tmp_path / "index", tmp_path / "real"
    target.mkdir()
    if kind == "link":
        out.symlink_to(target)
    else:
        out.write_text("a file")
    with pytest.raises(OmnifeedError, match="a symbolic link" if kind == "link" else "exists and is not a folder"):
        build_index([shard(tmp_path / "a.tar", ["a1"])], out, CONFIG, progress=False)
    assert list(target.iterdir()) == [] and leftovers(tmp_path) == []


def test_a_build_that_fails_leaves_the_old_index_and_no_temporary_folder(tmp_path: Path) -> None:
    out = tmp_path / "index"
    before = build([shard(tmp_path / "a.tar", ["a1"])], out).fingerprint
    (tmp_path / "broken.tar").write_bytes(b"not a tar file" * 100)
    with pytest.raises(SourceError, match="no sample could be indexed"):
        build_index([str(tmp_path / "broken.tar")], out, CONFIG, progress=False)
    assert SampleIndex(out).fingerprint == before and leftovers(tmp_path) == []


def test_writing_an_index_from_tables_follows_the_same_rule(tmp_path: Path) -> None:
    from omnifeed.loader.index import ROW_SCHEMA, write_index_from_tables

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(OmnifeedError):
        write_index_from_tables([ROW_SCHEMA.empty_table()], [], [], folder)
    assert (folder / "notes.txt").read_text(encoding="utf-8") == "keep me"
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def _owner(folder: Path, **owner: object) -> Path:
    """``folder`` made as a building folder whose owner file says ``owner``."""
    from omnifeed.loader.index._out_dir import BUILD_OWNER

    folder.mkdir()
    (folder / BUILD_OWNER).write_text(json.dumps(owner))
    (folder / "part-00000.parquet").write_bytes(b"partial")
    return folder


def test_a_building_folder_left_by_a_killed_run_is_removed_by_the_next_run_and_nothing_else(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    from omnifeed.loader.index._out_dir import _started

    out = tmp_path / "index"
    killed = subprocess.run(  # a run that made its building folder and died without cleaning up (as after SIGKILL)
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from omnifeed.loader.index._out_dir import building_folder; "
            "print(building_folder(pathlib.Path(sys.argv[1])))",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    left = Path(killed.stdout.strip())
    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        ).stdout
    )
    (left / ".spill").mkdir()
    (left / ".spill" / "0.arrows").write_bytes(b"\0" * 4096)
    host = socket.gethostname()
    running = _owner(tmp_path / ".index.building-running", pid=os.getppid(), host=host, start=_started(os.getppid()))
    elsewhere = _owner(tmp_path / ".index.building-node7", pid=dead, host="node7", start=None)
    unmarked = tmp_path / ".index.building-notes"
    unmarked.mkdir()
    (unmarked / "notes.txt").write_text("mine")
    other_out = _owner(tmp_path / ".other.building-x", pid=dead, host=host, start=None)
    build([shard(tmp_path / "a.tar", ["a1"])], out)
    assert not left.exists(), "its process is gone: provably a dead build of this --out"
    assert running.exists() and elsewhere.exists() and (unmarked / "notes.txt").read_text() == "mine"
    assert other_out.exists(), "another --out's building folder is that build's business"
