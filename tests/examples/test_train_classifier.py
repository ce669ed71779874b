"""examples/train_classifier.py as a user runs it: index a Hugging Face Parquet dataset, train, get killed, resume.

The script runs as a real subprocess each time. A run killed with SIGKILL and resumed from its
last checkpoint must see exactly the batches of an uninterrupted run from that step on: the same
keys and the same augmented pixels (the crops and flips are seeded by plan seed, epoch and key).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import yaml
from feed_service import ServiceProcess, short_socket_dir, write_config
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_classifier.py"
OMNIFEED = str(Path(sys.executable).with_name("omnifeed"))
FEED = {
    "plan": {"seed": 7, "batch_size": 8},  # 64 samples: 8 steps an epoch, 24 steps cross two epoch boundaries
    "transforms": {
        "image": [{"random_resized_crop": {"size": 32, "scale": [0.5, 1.0]}}, {"horizontal_flip": {"p": 0.5}}]
    },
}
STEPS, SAVE_EVERY, KILL_AFTER = 24, 4, 6
COMPARED = ("step", "epoch", "keys", "labels", "pixels", "shape")  # not the loss: float sums need not be bitwise equal


def write_dataset(path: Path, count: int = 64, classes: int = 4) -> Path:
    """A Parquet table as Hugging Face `datasets` writes it: an ``Image`` column (images of varied sizes,
    coloured by class) and a ``ClassLabel`` column ``label``; no key column (the keys are ``train/<row>``)."""
    rng = np.random.default_rng(0)
    colours = np.array([(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)])
    images = []
    for i in range(count):
        height, width = rng.integers(36, 56, 2)
        images.append(
            Image.fromarray(
                np.clip(colours[i % classes] + rng.normal(0, 30, (height, width, 3)), 0, 255).astype(np.uint8)
            )
        )
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=classes)})
    table = datasets.Dataset.from_dict(
        {"image": images, "label": [i % classes for i in range(count)]}, features=features
    )
    table.to_parquet(str(path))
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The dataset indexed with `omnifeed index`, a feed YAML, and one uninterrupted run's batch log."""
    work = tmp_path_factory.mktemp("classifier")
    parquet = write_dataset(work / "train.parquet")
    run([OMNIFEED, "index", str(parquet), "--out", str(work / "index"), "--no-progress"])
    (work / "feed.yaml").write_text(yaml.safe_dump(FEED), encoding="utf-8")
    paths = {"work": work, "index": work / "index", "config": work / "feed.yaml", "log": work / "uninterrupted.jsonl"}
    run(train_command(paths, work / "uninterrupted.pt", paths["log"]))
    return paths


def run(command: list[str]) -> None:
    """Run a command to its end; fail with what it printed unless it exits 0."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"


def train_command(paths: dict[str, Path], checkpoint: Path, log: Path, *source: str) -> list[str]:
    """The script's command line: in-process over the index, or ``source`` (``--socket PATH``)."""
    source = source or ("--index", str(paths["index"]), "--config", str(paths["config"]))
    return [
        sys.executable,
        str(SCRIPT),
        *source,
        "--num-classes",
        "4",
        "--max-steps",
        str(STEPS),
        "--checkpoint",
        str(checkpoint),
        "--save-every",
        str(SAVE_EVERY),
        "--log-batches",
        str(log),
    ]


def read_log(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of a batch log (a killed run may leave half a line)."""
    if not path.exists():
        return []
    return [
        json.loads(line) for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if line.endswith("\n")
    ]


def compared(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{name: r[name] for name in COMPARED} for r in records]


@pytest.mark.timeout(300)
def test_the_uninterrupted_run_trains_on_int64_labels_with_a_finite_loss(dataset: dict[str, Path]) -> None:
    log = read_log(dataset["log"])
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert {r["epoch"] for r in log} == {0, 1, 2}
    assert all(r["label_dtype"] == "torch.int64" and r["shape"] == [8, 3, 32, 32] for r in log)
    assert all(math.isfinite(r["loss"]) for r in log)
    seen = [key for r in log[:8] for key in r["keys"]]
    assert sorted(seen) == sorted(f"train/{row}" for row in range(64))  # the first epoch: each sample once
    assert all(int(key.split("/")[1]) % 4 == label for r in log for key, label in zip(r["keys"], r["labels"]))


@pytest.mark.timeout(300)
def test_a_run_killed_and_resumed_sees_the_uninterrupted_batches(dataset: dict[str, Path], tmp_path: Path) -> None:
    checkpoint, killed_log, resumed_log = tmp_path / "run.pt", tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    process = subprocess.Popen(
        train_command(dataset, checkpoint, killed_log), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        while len(read_log(killed_log)) < KILL_AFTER and process.poll() is None:
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, stderr.decode()
    run(train_command(dataset, checkpoint, resumed_log))

    uninterrupted, killed, resumed = read_log(dataset["log"]), read_log(killed_log), read_log(resumed_log)
    assert compared(killed) == compared(uninterrupted[: len(killed)])
    saved_step = resumed[0]["step"] - 1  # the last checkpoint the killed run wrote
    assert saved_step % SAVE_EVERY == 0 and KILL_AFTER - SAVE_EVERY < saved_step < STEPS
    assert compared(resumed) == compared(uninterrupted[saved_step:])  # keys, labels and augmented pixels
    assert all(math.isfinite(r["loss"]) and r["label_dtype"] == "torch.int64" for r in resumed)


@pytest.mark.timeout(300)
def test_through_a_service_the_batches_are_the_in_process_ones(dataset: dict[str, Path], tmp_path: Path) -> None:
    socket_dir = short_socket_dir()
    socket, log = socket_dir / "feed.sock", tmp_path / "service.jsonl"
    service = ServiceProcess(write_config(tmp_path, dataset["index"], socket=socket, feed=FEED), socket).start()
    try:
        run(train_command(dataset, tmp_path / "run.pt", log, "--socket", str(socket)))
    finally:
        assert service.stop() == 0, service.output()
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert compared(read_log(log)) == compared(read_log(dataset["log"]))
