"""`omnifeed bench --quick`: the harness runs each installed loader, reports the others, and writes its report and
plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnifeed.tools._bench import installed

_CLI = "from omnifeed.tools._cli import main; raise SystemExit(main())"


@pytest.mark.soak
def test_quick_bench_runs_each_installed_loader_over_every_sample(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    loaders = "omnifeed,omnifeed-service,dataloader,webloader,dali"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _CLI,
            "bench",
            "--quick",
            "--loaders",
            loaders,
            "--resume-samples",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    rows = {(r["loader"], r["pipeline"]): r for r in report["rows"]}
    assert set(rows) == {(loader, p) for loader in loaders.split(",") for p in ("image", "mixed")}
    for pipeline, total in (("image", 64), ("mixed", 32)):
        assert report["decode_limit"][pipeline]["limit_samples_per_s"] > 0
        for loader in ("omnifeed", "omnifeed-service", "dataloader", "webloader"):
            row = rows[(loader, pipeline)]
            assert row["status"] == "ok", row
            assert row["samples"] == total  # one epoch: every sample once
            # CPU time has a clock tick's resolution (10 ms): a quick run's few batches after the first may show none
            assert row["samples_per_s"] > 0 and row["cpu_s_per_sample"] >= 0 and row["peak_pss_mib"] > 0
        assert rows[("dataloader", pipeline)]["vs_dataloader"] == 1.0
    assert rows[("dali", "mixed")]["status"].startswith("n/a")
    dali = rows[("dali", "image")]["status"]
    assert dali == "ok" if installed("dali", sys.executable) is None else dali.startswith("missing:")
    assert "| omnifeed-service |" in run.stdout and "decode limit" in run.stdout
    node = {(r["layout"], r["loader"]): r for r in report["node"]}  # 2 ranks: data-parallel, then tensor-parallel peers
    assert set(node) == {(layout, loader) for layout in ("dp", "tp") for loader in ("dataloader", "omnifeed-service")}
    for (layout, loader), row in node.items():
        assert row["status"] == "ok", row
        assert sum(row["samples"]) == (64 if layout == "dp" else 2 * 64)  # a share each, or the whole epoch per peer
        assert (row["service_start_s"] is not None) == (loader == "omnifeed-service")
    assert node[("tp", "dataloader")]["vs_dataloader"] == 1.0 and "| tp | 2 | omnifeed-service |" in run.stdout
    assert (out / "bench.png").stat().st_size > 0


def test_unknown_loader_is_a_usage_error(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _CLI,
            "bench",
            "--quick",
            "--loaders",
            "omnifeed,fastloader",
            "--out",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "fastloader" in run.stderr and "dataloader" in run.stderr


@pytest.mark.parametrize("layout", ["files", "shards"])
def test_takes_a_users_images_as_files_or_shards(tmp_path: Path, layout: str) -> None:
    from omnifeed.tools._bench_config import BenchConfig
    from omnifeed.tools._bench_dataset import _shards_to_folder, prepare_datasets, write_images

    shards = write_images(tmp_path / "given-shards", 12)
    given = tmp_path / "given"
    if layout == "files":
        _shards_to_folder(shards, given)
    else:
        given = tmp_path / "given-shards"
    datasets = prepare_datasets(BenchConfig(work=tmp_path / "work", pipelines=["image"], data=given))
    image = datasets["image"]
    assert image.samples == 12
    assert len(list(Path(image.folder).glob("*.jpg"))) == 12
