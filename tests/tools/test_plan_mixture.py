"""`omnifeed plan` and `omnifeed verify` over a mixture named by a config file (issue 31): per-source stats, and
each source's delivery checked against the schedule. Each command a process of its own, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnifeed.loader import IndexConfig, build_index

OMNIFEED = [str(Path(sys.executable).with_name("omnifeed"))]
MIXTURE = {
    "sources": {
        "tars": {"index": "indexes/tar-index", "weight": 0.7},
        "table": {"index": "indexes/parquet-index", "weight": 0.3, "where": {"text_tokens": [1, 30]}},
    }
}


def run(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`omnifeed ARGS` from the repository's folder, not the config's (its paths must resolve beside the file)."""
    result = subprocess.run([*OMNIFEED, *args], capture_output=True, text=True, input=stdin, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"omnifeed {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def config(index_dir: Path, demo_parquet: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan config naming two indexes of the demo data (its tar shards, its Parquet file) by relative paths."""
    folder = tmp_path_factory.mktemp("mixture-cli")
    (folder / "indexes").mkdir()
    (folder / "indexes" / "tar-index").symlink_to(index_dir)
    build_index([str(demo_parquet)], folder / "indexes" / "parquet-index", IndexConfig(workers=1), progress=False)
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump({"plan": {"seed": 4, "batch_size": 4, "mixture": MIXTURE}}, sort_keys=False))
    return path


def test_plan_stats_report_each_sources_shares_padding_and_what_its_filter_removed(config: Path) -> None:
    stats = json.loads(run("plan", "--config", str(config), "--world-size", "2", "--stats").stdout)
    sources = stats["sources"]
    assert list(sources) == ["tars", "table"]
    total = stats["samples"]
    for figures in sources.values():
        assert abs(figures["share"] - figures["planned_share"]) <= 1 / total  # within a sample of the schedule
        assert 0 < figures["cost_share"] < 1 and figures["padding_fraction"]
        assert all(0 <= v < 1 for v in figures["padding_fraction"].values())
    assert abs(sources["tars"]["planned_share"] - 0.7) < 0.03
    assert sum(s["samples"] for s in sources.values()) == total  # the epoch's micro-batches, every one of a source
    assert abs(sum(s["cost_share"] for s in sources.values()) - 1) < 1e-5
    assert sources["table"]["removed_by_filter"] > 0 and sources["tars"]["removed_by_filter"] == 0
    assert "image" in sources["tars"]["padding_fraction"]


def test_plan_of_a_mixture_names_keys_by_source_and_verify_checks_each_source(config: Path, tmp_path: Path) -> None:
    log = run("plan", "--config", str(config), "--world-size", "2").stdout
    keys = [k for line in log.splitlines() for k in json.loads(line)["keys"]]
    assert {k.split("/")[0] for k in keys} == {"tars", "table"}
    done = run("verify", "--config", str(config), "-", "--epoch", "0", stdin=log)
    report = json.loads(done.stdout)
    assert report["ok"] and set(report["sources"]) == {"tars", "table"}
    assert all(
        s["missing"] == s["duplicates"] == 0 and s["planned"] == s["delivered"] for s in report["sources"].values()
    )
    lines = log.splitlines()
    dropped = next(i for i, line in enumerate(lines) if any(k.startswith("table/") for k in json.loads(line)["keys"]))
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines[:dropped] + lines[dropped + 1 :]) + "\n")
    failed = run("verify", "--config", str(config), str(tampered), "--epoch", "0", check=False)
    assert failed.returncode == 1 and not json.loads(failed.stdout)["ok"]
    assert json.loads(failed.stdout)["sources"]["table"]["missing"] > 0
    assert "table" in failed.stderr and "missing" in failed.stderr


def test_an_index_dir_beside_a_mixture_config_is_refused_in_one_line_saying_what_to_drop(
    config: Path, index_dir: Path
) -> None:
    result = run("plan", str(index_dir), "--config", str(config), "--world-size", "2", check=False)
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "drop INDEX_DIR" in line and str(config) in line
    result = run("plan", "--world-size", "2", check=False)
    assert result.returncode == 2 and "INDEX_DIR" in result.stderr


def test_a_mixture_plan_resumes_from_its_state_file_alone_at_another_world_size(config: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    head = run("plan", "--config", str(config), "--world-size", "2", "--steps", "3", "--save-state", str(state)).stdout
    tail = run("plan", "--world-size", "3", "--resume", str(state)).stdout
    report = json.loads(run("verify", "--config", str(config), "-", "--epoch", "0", stdin=head + tail).stdout)
    assert report["ok"], report


@pytest.mark.parametrize(
    "batching", [["--budget", "60000", "--overlong", "alone"], ["--budget", "300", "--packing", "--overlong", "split"]]
)
def test_bucketed_and_packed_mixtures_report_per_source_and_verify_with_samples_repeated_in_the_epoch(
    config: Path, batching: list[str]
) -> None:
    stats = json.loads(run("plan", "--config", str(config), "--world-size", "2", *batching, "--stats").stdout)
    sources = stats["sources"]
    for figures in sources.values():  # a sample split across packs counts once
        assert abs(figures["share"] - figures["planned_share"]) <= 1 / sum(s["samples"] for s in sources.values())
        assert figures["padding_fraction"] and 0 < figures["cost_share"] < 1
    log = run("plan", "--config", str(config), "--world-size", "2", *batching).stdout
    report = json.loads(run("verify", "--config", str(config), "-", "--epoch", "0", stdin=log).stdout)
    assert report["ok"] and report["partial"] == 0
    assert report["sources"]["tars"]["planned"] > 48  # 70 % of 88: the 48 tar samples, some twice, split differently


def test_verify_refuses_an_index_dir_beside_a_mixture_config_and_a_config_without_a_mixture(
    config: Path, index_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text("")
    result = run("verify", str(index_dir), str(log), "--config", str(config), "--epoch", "0", check=False)
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "drop INDEX_DIR" in line
    single = tmp_path / "single.yaml"
    single.write_text("plan: {seed: 1}\n")
    result = run("verify", "--config", str(single), str(log), "--epoch", "0", check=False)
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "no mixture" in line


def test_new_weights_on_resume_are_refused_in_one_line_unless_the_change_is_allowed(
    config: Path, tmp_path: Path
) -> None:
    state, changed = tmp_path / "state.json", tmp_path / "changed.yaml"
    run("plan", "--config", str(config), "--world-size", "2", "--steps", "3", "--save-state", str(state))
    section = yaml.safe_load(config.read_text())
    section["plan"]["mixture"]["sources"]["tars"]["weight"] = 0.2
    changed.write_text(yaml.safe_dump(section, sort_keys=False))
    (tmp_path / "indexes").symlink_to(config.parent / "indexes")
    refused = run("plan", "--config", str(changed), "--world-size", "2", "--resume", str(state), check=False)
    assert refused.returncode == 1 and "--allow-mixture-change" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    allowed = run(
        "plan", "--config", str(changed), "--world-size", "2", "--resume", str(state), "--allow-mixture-change"
    )
    assert allowed.stdout.count("\n") > 0


def test_a_budgeted_mixture_s_epochs_written_ahead_beside_its_config_deal_the_same_and_resume_exactly_once(
    config: Path, tmp_path: Path
) -> None:
    """`--write-epochs` with a mixture writes into `plan.mixture.plans` (relative to the config file); dealing from
    the files prints what live planning printed; a state saved on them resumes at another world size exactly once;
    without a `plans` folder, one line says what to set."""
    budget = ["--budget", "60000", "--overlong", "alone"]
    live = run("plan", "--config", str(config), "--world-size", "3", *budget).stdout
    refused = run("plan", "--config", str(config), *budget, "--write-epochs", "1", check=False)
    (line,) = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and "set plan.mixture.plans" in line
    data = yaml.safe_load(config.read_text())
    data["plan"]["mixture"]["plans"] = "written-plans"
    planned = config.with_name("mix-planned.yaml")
    planned.write_text(yaml.safe_dump(data, sort_keys=False))
    written = [
        json.loads(x) for x in run("plan", "--config", str(planned), *budget, "--write-epochs", "2").stdout.splitlines()
    ]
    assert [w["epoch"] for w in written] == [0, 1]
    assert len(list((config.parent / "written-plans").glob("*/epoch-*/mixture.json"))) == 2
    assert run("plan", "--config", str(planned), "--world-size", "3", *budget).stdout == live
    state = tmp_path / "state.json"
    head = run(
        "plan", "--config", str(planned), "--world-size", "3", *budget, "--steps", "2", "--save-state", str(state)
    ).stdout
    tail = run("plan", "--config", str(planned), "--world-size", "2", *budget, "--resume", str(state)).stdout
    report = json.loads(run("verify", "--config", str(planned), "-", "--epoch", "0", stdin=head + tail).stdout)
    assert report["ok"], report


def test_after_a_weight_change_the_epochs_are_written_from_the_state_and_deal_what_live_planning_does(
    config: Path, tmp_path: Path
) -> None:
    """`--resume STATE --allow-mixture-change --write-epochs N` writes the new weights' epochs from the state's next
    whole epoch (an earlier `--epoch` is refused in one line); resuming the state deals what live planning deals."""
    budget = ["--budget", "60000", "--overlong", "alone"]
    data = yaml.safe_load(config.read_text())
    data["plan"]["mixture"]["plans"] = "changed-plans"
    before = config.with_name("mix-before.yaml")
    before.write_text(yaml.safe_dump(data, sort_keys=False))
    sources = data["plan"]["mixture"]["sources"]
    sources["tars"]["weight"], sources["table"]["weight"] = 0.2, 0.8
    after = config.with_name("mix-after.yaml")
    after.write_text(yaml.safe_dump(data, sort_keys=False))
    state = tmp_path / "state.json"
    run("plan", "--config", str(before), "--world-size", "2", *budget, "--steps", "2", "--save-state", str(state))
    change = ["--resume", str(state), "--allow-mixture-change"]
    refused = run("plan", "--config", str(after), *budget, *change, "--write-epochs", "1", "--epoch", "0", check=False)
    (line,) = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and "write from --epoch 1 on" in line
    written = run("plan", "--config", str(after), *budget, *change, "--write-epochs", "1").stdout
    assert json.loads(written)["epoch"] == 1
    del data["plan"]["mixture"]["plans"]
    live_config = config.with_name("mix-after-live.yaml")
    live_config.write_text(yaml.safe_dump(data, sort_keys=False))
    deal = ["--world-size", "3", *budget, *change, "--epoch", "1"]  # the rest of epoch 0 (live), then epoch 1
    live = run("plan", "--config", str(live_config), *deal).stdout
    planned = run("plan", "--config", str(after), *deal)
    assert live and planned.stdout == live
    assert "another history" not in planned.stderr and "epoch 1 of this budget was not written" not in planned.stderr
