"""Smoke test of the resume benchmark: every loader has a row, the resumed batches are the right ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnifeed.tools._bench_resume import run_resume_bench
from omnifeed.tools._bench_resume_torchdata import shift_torchdata_state, torchdata_state


def test_every_loader_resumes_at_the_right_batch(tmp_path: Path) -> None:
    rows = run_resume_bench(tmp_path, samples=20_000, torchdata_workers=(0,), timeout_s=300)
    by_loader = {row["loader"]: row for row in rows}
    assert set(by_loader) == {"omnifeed", "torchdata", "streaming"}
    for name in ("omnifeed", "torchdata"):
        row = by_loader[name]
        assert row["status"] == "ok", row
        assert row["first_batch_ok"] is True
        assert row["position"] == 10_000 // 64 * 64
        assert row["resume_s"] > 0 and row["open_s"] >= 0 and row["peak_rss_mib"] > 0 and row["state_bytes"] > 0
    assert by_loader["omnifeed"]["state_bytes"] < 1_000  # a cursor: constant size
    streaming = by_loader["streaming"]
    assert streaming["status"] == "ok" or streaming["status"].startswith("missing:"), streaming
    if streaming["status"] == "ok":
        assert streaming["first_batch_ok"] is True


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shifted_torchdata_state_is_the_state_of_iterating_there(workers: int) -> None:
    real, expected, how = torchdata_state(2_000, 16, workers, 40)
    assert how.startswith("iterated for real")
    early, _, _ = torchdata_state(2_000, 16, workers, 3)
    shifted = shift_torchdata_state(early, 40, 16, workers)
    assert _plain(shifted) == _plain(real)
    deep, computed, how = torchdata_state(2_000, 16, workers, 40, iterate_limit=10)
    assert how.startswith("a real state") and computed == expected


def _plain(value: object) -> object:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value
