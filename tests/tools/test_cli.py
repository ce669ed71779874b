"""The `omnifeed` command line as a user runs it: each command a process of its own, real files (cli_runner)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runner import CliRunner

from omnifeed.tools._cli import _parser

OMNIFEED = [str(Path(sys.executable).with_name("omnifeed"))]
_forked: CliRunner | None = None


@pytest.fixture(scope="module", autouse=True)
def forked_commands() -> Iterator[None]:
    """Commands run in processes forked from an interpreter that imported the command line once (cli_runner)."""
    global _forked
    _forked = CliRunner()
    yield
    _forked.close()
    _forked = None


def run(
    *args: str, check: bool = True, stdin: str | None = None, script: bool = False
) -> subprocess.CompletedProcess[str]:
    """`omnifeed ARGS` in a process of its own; ``script``: start the console script itself, as a shell does."""
    if script or _forked is None:
        result = subprocess.run([*OMNIFEED, *args], capture_output=True, text=True, input=stdin, timeout=300)
    else:
        result = _forked.run(*args, stdin=stdin, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(
            f"omnifeed {' '.join(args)} exited {result.returncode}:\n{result.stderr}\n"
            f"stdout, last lines:\n{result.stdout[-3000:]}"
        )
    return result


@pytest.fixture(scope="module")
def index_dir(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "index"
    pattern = str(demo_shards[0]).replace("0000", f"{{0000..{len(demo_shards) - 1:04d}}}")
    result = run(
        "index",
        pattern,
        "--out",
        str(out),
        "--partitions",
        "3",
        "--workers",
        "2",
        "--no-progress",
        "--json",
        script=True,
    )
    summary = json.loads(result.stdout)
    assert summary["samples"] > 0 and summary["shards"] == len(demo_shards) and summary["errors"] == 0
    return out


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_plan_prints_one_line_per_micro_batch_until_the_epoch_is_delivered(index_dir: Path) -> None:
    lines = records(run("plan", str(index_dir), "--seed", "1", "--world-size", "3", "--batch-size", "4").stdout)
    assert {"epoch", "step", "rank", "keys"} <= set(lines[0])
    per_step = Counter(r["step"] for r in lines)
    assert set(per_step.values()) == {3}, "every step gives each of the 3 ranks a micro-batch"
    keys = [k for r in lines if r["epoch"] == 0 for k in r["keys"]]
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert len(keys) == len(set(keys)) == manifest["num_samples"]


def test_resume_at_another_world_size_then_verify_exactly_once(index_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    first = run(
        "plan",
        str(index_dir),
        "--seed",
        "7",
        "--world-size",
        "4",
        "--batch-size",
        "2",
        "--steps",
        "3",
        "--save-state",
        str(state),
    ).stdout
    second = run("plan", str(index_dir), "--world-size", "3", "--resume", str(state)).stdout
    assert [r["step"] for r in records(second)][0] == 3, "steps continue across resumes"
    log = tmp_path / "delivery.jsonl"
    log.write_text(first + second)
    report = json.loads(run("verify", str(index_dir), str(log), "--epoch", "0").stdout)
    assert report["ok"] and report["duplicates"] == report["missing"] == 0
    assert report["delivered"] == report["samples"]


def test_resume_equals_an_uninterrupted_run(index_dir: Path, tmp_path: Path) -> None:
    base = ["plan", str(index_dir), "--seed", "3", "--world-size", "2", "--grad-accum", "2", "--batch-size", "3"]
    whole = records(run(*base, "--steps", "6").stdout)
    state = tmp_path / "s.json"
    head = records(run(*base, "--steps", "2", "--save-state", str(state)).stdout)
    tail = records(run(*base, "--steps", "4", "--resume", str(state)).stdout)
    assert head + tail == whole


def test_verify_fails_on_a_duplicate_or_a_missing_sample(index_dir: Path, tmp_path: Path) -> None:
    lines = run("plan", str(index_dir), "--seed", "2", "--world-size", "2").stdout.splitlines()
    duplicated = tmp_path / "dup.jsonl"
    duplicated.write_text("\n".join(lines + lines[:1]) + "\n")
    result = run("verify", str(index_dir), "--epoch", "0", str(duplicated), check=False)  # logs after the options
    assert result.returncode == 1 and json.loads(result.stdout)["duplicates"] > 0
    result = run("verify", str(index_dir), "-", "--epoch", "0", check=False, stdin="\n".join(lines[1:]))
    assert result.returncode == 1 and json.loads(result.stdout)["missing"] > 0


def test_a_state_from_another_index_is_refused_naming_both_fingerprints(
    index_dir: Path, demo_shards: list[Path], tmp_path: Path
) -> None:
    other = tmp_path / "other"
    run("index", str(demo_shards[0]), "--out", str(other), "--no-progress")
    state = tmp_path / "state.json"
    run("plan", str(other), "--seed", "0", "--world-size", "2", "--steps", "1", "--save-state", str(state))
    result = run("plan", str(index_dir), "--world-size", "2", "--resume", str(state), check=False)
    assert result.returncode == 1
    mine = json.loads((index_dir / "manifest.json").read_text())["fingerprint"]
    theirs = json.loads((other / "manifest.json").read_text())["fingerprint"]
    assert mine in result.stderr and theirs in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_index_exits_nonzero_naming_a_bad_shard_and_keeps_the_rest(demo_shards: list[Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"\0garbage" * 100)
    result = run(
        "index", str(demo_shards[0]), str(bad), "--out", str(tmp_path / "index"), "--no-progress", "--json", check=False
    )
    assert result.returncode == 1
    assert str(bad) in result.stderr
    assert json.loads(result.stdout)["samples"] > 0


def test_errors_are_one_line_with_nonzero_exit(tmp_path: Path) -> None:
    result = run("plan", str(tmp_path), "--world-size", "2", check=False, script=True)
    assert result.returncode == 1
    assert result.stderr.startswith("omnifeed: error:") and "omnifeed index" in result.stderr


@pytest.mark.parametrize("shuffle", ["shard_block", "none"])
def test_every_shuffle_mode_delivers_exactly_once_across_a_resize(
    index_dir: Path, tmp_path: Path, shuffle: str
) -> None:
    state, log = tmp_path / "state.json", tmp_path / "log.jsonl"
    head = run(
        "plan",
        str(index_dir),
        "--seed",
        "4",
        "--world-size",
        "2",
        "--shuffle",
        shuffle,
        "--shards-per-window",
        "1",
        "--batch-size",
        "5",
        "--steps",
        "2",
        "--save-state",
        str(state),
    ).stdout
    tail = run("plan", str(index_dir), "--world-size", "5", "--resume", str(state)).stdout
    log.write_text(head + tail)
    assert json.loads(run("verify", str(index_dir), str(log), "--epoch", "0").stdout)["ok"]


def test_a_malformed_log_line_is_named_by_file_and_line(index_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('{"epoch": 0, "step": 0, "rank": 0, "keys": []}\nnot json\n')
    result = run("verify", str(index_dir), str(log), "--epoch", "0", check=False)
    assert result.returncode == 1 and f"{log}:2" in result.stderr


def test_budget_stats_compare_with_fixed_size_batches(index_dir: Path) -> None:
    result = run(
        "plan",
        str(index_dir),
        "--seed",
        "1",
        "--world-size",
        "2",
        "--budget",
        "60000",
        "--overlong",
        "alone",
        "--stats",
    )
    (line,) = result.stdout.splitlines()
    stats = json.loads(line)
    assert {"micro_batches", "padding_fraction", "balance_max_over_mean", "fixed_batch_size"} <= set(stats)
    assert {"worst", "mean"} == set(stats["balance_max_over_mean"])
    assert stats["fixed_batch_size"]["batch_size"] == 8


def test_worst_lists_the_costliest_micro_batches_first(index_dir: Path) -> None:
    rows = records(
        run(
            "plan", str(index_dir), "--world-size", "2", "--budget", "60000", "--overlong", "alone", "--worst", "3"
        ).stdout
    )
    assert len(rows) == 3 and [r["cost"] for r in rows] == sorted((r["cost"] for r in rows), reverse=True)
    assert all(r["keys"] and r["longest"] for r in rows)


@pytest.mark.parametrize(
    "batching", [["--budget", "60000", "--overlong", "alone"], ["--budget", "300", "--packing", "--overlong", "split"]]
)
def test_bucketed_and_packed_plans_resume_at_another_world_size_exactly_once(
    index_dir: Path, tmp_path: Path, batching: list[str]
) -> None:
    state, log = tmp_path / "state.json", tmp_path / "log.jsonl"
    head = run(
        "plan",
        str(index_dir),
        "--seed",
        "5",
        "--world-size",
        "3",
        *batching,
        "--steps",
        "2",
        "--save-state",
        str(state),
    ).stdout
    tail = run("plan", str(index_dir), "--world-size", "2", "--resume", str(state)).stdout
    log.write_text(head + tail)
    report = json.loads(run("verify", str(index_dir), str(log), "--epoch", "0").stdout)
    assert report["ok"], report


def test_a_sample_over_the_budget_is_named_in_a_one_line_error(index_dir: Path) -> None:
    result = run("plan", str(index_dir), "--world-size", "2", "--budget", "50", check=False)
    assert (
        result.returncode == 1
        and "sample 'sample-" in result.stderr
        and "over the micro-batch budget 50" in result.stderr
    )


def test_verify_still_takes_the_index_by_its_old_flag(index_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(run("plan", str(index_dir), "--seed", "6", "--world-size", "2").stdout)
    for args in (["--index", str(index_dir), "--epoch", "0", str(log)], [str(index_dir), str(log), "--epoch", "0"]):
        assert json.loads(run("verify", *args).stdout)["ok"]
    result = run("verify", str(index_dir), "--epoch", "0", check=False)
    assert result.returncode == 2 and "delivery logs" in result.stderr


# -- errors are one line ------------------------------------------------------------------------


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("omnifeed: error: ")
    return line


def test_malformed_yaml_is_one_line_naming_file_line_and_column(tmp_path: Path) -> None:
    config = tmp_path / "service.yaml"
    config.write_text("index: idx\nfeed:\n  plan: {seed: 1\n  pools: {}\n")
    line = one_line_error(run("serve", "--config", str(config), check=False))
    assert f"{config}:4:" in line and "not valid YAML" in line


def test_an_unknown_key_is_one_line_naming_the_closest_valid_one(tmp_path: Path) -> None:
    config = tmp_path / "service.yaml"
    config.write_text("index: idx\nfeed:\n  pools:\n    image: {wrkers: 2}\n")
    line = one_line_error(run("serve", "--config", str(config), check=False))
    assert f"{config}:4:13: feed.pools.image.wrkers: unknown key; did you mean 'workers'?" in line


def test_a_value_out_of_range_is_one_line_with_the_allowed_range(index_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "omnifeed.yaml"
    config.write_text("plan:\n  seed: 1\n  batch_size: 0\n")
    line = one_line_error(run("plan", str(index_dir), "--world-size", "2", "--config", str(config), check=False))
    assert line.endswith(f"{config}:3:3: plan.batch_size = 0: out of range, must be at least 1")
    line = one_line_error(run("index", "x.tar", "--out", str(tmp_path / "i"), "--partitions", "2000", check=False))
    assert line.endswith("--partitions 2000: out of range, must be from 1 to 1024")


@pytest.mark.parametrize(
    ("args", "text", "meant"),
    [
        (
            ["index", "{tmp}/shard.tar", "--out", "{tmp}/i"],
            "idnex:\n  partitions: 2\n",
            "1:1: idnex: unknown key; did you mean 'index'?",
        ),
        (
            ["plan", "{index}", "--world-size", "2"],
            "plna: {{seed: 1}}\n",
            "1:1: plna: unknown key; did you mean 'plan'?",
        ),
        (
            ["precache", "{index}", "--cache", "{tmp}/cache"],
            "idnex: {{}}\n",
            "1:1: idnex: unknown key; did you mean 'index'?",
        ),
        (["serve"], "index: {index}\nfeeed: {{}}\n", "2:1: feeed: unknown key; did you mean 'feed'?"),
    ],
    ids=["index", "plan", "precache", "serve"],
)
def test_a_misspelled_section_is_refused_by_every_command_in_the_same_line(
    index_dir: Path, tmp_path: Path, args: list[str], text: str, meant: str
) -> None:
    config = tmp_path / "omnifeed.yaml"
    values = {"tmp": str(tmp_path), "index": str(index_dir)}
    config.write_text(text.format(**values))
    line = one_line_error(run(*(arg.format(**values) for arg in args), "--config", str(config), check=False))
    assert line == f"omnifeed: error: {config}:{meant}"


def test_index_ends_with_a_human_summary_of_a_folder_of_shards(demo_shards: list[Path], tmp_path: Path) -> None:
    result = run(
        "index", str(demo_shards[0].parent), "--out", str(tmp_path / "index"), "--workers", "1", "--no-progress"
    )
    lines = result.stdout.splitlines()
    assert lines[0] == f"omnifeed: indexed 48 samples from {len(demo_shards)} shards into {tmp_path / 'index'}"
    assert lines[2].startswith("samples with: text ") and any(
        line.split()[:3] == ["image", "width", "px"] for line in lines
    )
    assert lines[-1] == "damaged: 0" and result.stderr == ""


def test_debug_adds_the_traceback(tmp_path: Path) -> None:
    config = tmp_path / "service.yaml"
    config.write_text("index: [\n")
    for args in (["--debug", "serve", "--config", str(config)], ["serve", "--config", str(config), "--debug"]):
        result = run(*args, check=False)
        assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(f"omnifeed: error: {config}:")


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "{missing}", "--world-size", "2"],
        ["precache", "{missing}", "--cache", "{tmp}/cache"],
        ["verify", "{missing}", "{tmp}/log.jsonl", "--epoch", "0"],
        ["serve", "--config", "{missing}/service.yaml"],
        ["index", "{tmp}/shard.tar", "--out", "{tmp}/index", "--config", "{missing}.yaml"],
        ["plan", "{index}", "--world-size", "2", "--resume", "{tmp}/bad-state.json"],
        ["plan", "{index}", "--world-size", "2", "--resume", "{missing}.json"],
        ["cache", "list", "--nvme", "{missing}"],
    ],
)
def test_common_mistakes_are_one_line_without_a_traceback(index_dir: Path, tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "bad-state.json").write_text("{not json")
    (tmp_path / "log.jsonl").write_text("")
    values = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path), "index": str(index_dir)}
    line = one_line_error(run(*(arg.format(**values) for arg in args), check=False))
    assert "missing" in line or "bad-state.json" in line


# -- one vocabulary, documented ------------------------------------------------------------------


def commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser (nested ones too: ``cache list``), by its name."""
    stack = [("omnifeed", _parser())]
    while stack:
        name, parser = stack.pop()
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend((f"{name} {sub}", child) for sub, child in action.choices.items())


def test_every_option_has_help_and_every_command_ends_its_help_with_examples() -> None:
    names = set()
    for name, parser in commands():
        names.add(name)
        actions = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        actions += [
            a for sub in parser._actions if isinstance(sub, argparse._SubParsersAction) for a in sub._choices_actions
        ]
        undocumented = [action.dest for action in actions if not (action.help or "").strip()]
        assert not undocumented, f"{name}: options without help text: {undocumented}"
        text = parser.format_help().rstrip().splitlines()
        examples = text.index("examples:")
        assert 1 <= len(text) - examples - 1 <= 2 and all(
            line.startswith("  omnifeed ") for line in text[examples + 1 :]
        ), name
    assert {"omnifeed plan", "omnifeed verify", "omnifeed cache list", "omnifeed cache remove"} <= names


def test_the_index_directory_is_the_first_positional_everywhere() -> None:
    for name, parser in commands():
        positionals = [
            a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
        ]
        if any(a.metavar == "INDEX_DIR" for a in positionals):
            assert positionals[0].metavar == "INDEX_DIR", name
        assert not any("--index" in a.option_strings and a.help != argparse.SUPPRESS for a in parser._actions), name


def test_stats_say_when_the_budget_is_too_small_and_suggest_budget_proposes_one(index_dir: Path) -> None:
    stats = json.loads(
        run("plan", str(index_dir), "--world-size", "2", "--budget", "60000", "--overlong", "alone", "--stats").stdout
    )
    guidance = stats["budget_guidance"]
    assert {"samples_over_budget", "budget_holding_99", "budget_holding_100"} <= set(guidance)
    suggestion = json.loads(run("plan", str(index_dir), "--world-size", "2", "--suggest-budget", "4").stdout)
    assert suggestion["suggested_budget"] > 0 and suggestion["samples_per_micro_batch"] >= 1


def test_epochs_written_ahead_deal_the_same_and_resume_exactly_once(index_dir: Path, tmp_path: Path) -> None:
    """`--write-epochs` plans a budget's epochs once under the index; dealing from them prints what planning live
    printed, and a resize from a state saved on them delivers the epoch exactly once."""
    index = tmp_path / "index"
    shutil.copytree(index_dir, index)
    budget = ["--seed", "5", "--budget", "60000", "--overlong", "alone"]
    live = run("plan", str(index), "--world-size", "3", *budget).stdout
    written = records(run("plan", str(index), *budget, "--write-epochs", "2").stdout)
    epoch_0 = [r for r in records(live) if r["epoch"] == 0]
    assert [w["epoch"] for w in written] == [0, 1] and written[0]["micro_batches"] == len(epoch_0)
    assert len(list((index / "plans").glob("*/epoch-*"))) == 2
    assert run("plan", str(index), "--world-size", "3", *budget).stdout == live
    state, log = tmp_path / "state.json", tmp_path / "log.jsonl"
    head = run("plan", str(index), "--world-size", "3", *budget, "--steps", "2", "--save-state", str(state)).stdout
    tail = run("plan", str(index), "--world-size", "2", "--resume", str(state)).stdout
    log.write_text(head + tail)
    report = json.loads(run("verify", str(index), str(log), "--epoch", "0").stdout)
    assert report["ok"], report


def test_packing_written_ahead_deals_the_same_packs(index_dir: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(index_dir, index)
    packing = ["--seed", "2", "--budget", "64", "--packing", "--overlong", "split"]
    live = run("plan", str(index), "--world-size", "2", *packing).stdout
    run("plan", str(index), *packing, "--write-epochs", "1")
    assert run("plan", str(index), "--world-size", "2", *packing).stdout == live
    assert len(list((index / "plans").glob("*/epoch-0/segment_starts.npy"))) == 1


def test_write_epochs_of_fixed_size_batches_is_refused_in_one_line(index_dir: Path) -> None:
    line = one_line_error(run("plan", str(index_dir), "--write-epochs", "1", check=False))
    assert "only a cost budget's or packing's epochs are planned ahead" in line
    result = run("plan", str(index_dir), "--budget", "60000", check=False)
    assert result.returncode == 2 and "give --world-size" in result.stderr
