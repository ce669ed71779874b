"""Worker batches cross through reused shared-memory slots without ever being overwritten while in use."""

from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import Dataset

from omnifeed.loader import DataLoader

pytestmark = pytest.mark.timeout(120)


class Pictures(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"picture": torch.full((3, 8, 8), i, dtype=torch.uint8), "label": i, "name": f"p{i}"}


def expected(i: int, batch_size: int = 2) -> list[int]:
    return list(range(i * batch_size, (i + 1) * batch_size))


def test_batches_held_by_the_consumer_are_never_overwritten() -> None:
    loader = DataLoader(Pictures(), batch_size=2, num_workers=2)
    held = list(loader)  # more batches than slots: the rest fall back to torch's own hand-off
    for i, batch in enumerate(held):
        assert batch["label"].tolist() == expected(i)
        assert [int(p[0, 0, 0]) for p in batch["picture"]] == expected(i)
    handoff = loader.metrics()["handoff"]
    assert handoff["shared_memory"] >= 4 and handoff["pickled"] >= 1
    assert handoff["shared_memory"] + handoff["pickled"] == 12


def test_slots_are_reused_once_their_batch_is_gone() -> None:
    loader = DataLoader(Pictures(), batch_size=2, num_workers=2)
    kept = []
    for i, batch in enumerate(loader):
        if i in (0, 5):
            kept.append((i, batch))  # one batch of each worker lives on while later ones reuse other slots
    assert all(b["label"].tolist() == expected(i) for i, b in kept)
    assert loader.metrics()["handoff"] == {"shared_memory": 12, "pickled": 0}


def test_numpy_arrays_strings_and_repeated_tensors_arrive_intact() -> None:
    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        pictures = torch.stack([it["picture"] for it in items])
        return {
            "pictures": pictures,
            "again": pictures,
            "array": np.stack([it["picture"].numpy() for it in items]),
            "names": [it["name"] for it in items],
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(2.5),
        }

    batch = next(iter(DataLoader(Pictures(), batch_size=3, num_workers=1, collate_fn=collate)))
    assert batch["pictures"] is batch["again"] and batch["names"] == ["p0", "p1", "p2"]
    assert isinstance(batch["array"], np.ndarray) and batch["array"].dtype == np.uint8
    assert np.array_equal(batch["array"], batch["pictures"].numpy())
    assert batch["empty"].shape == (0, 3) and batch["scalar"].item() == 2.5


def worker_processes() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "forkserver" not in " ".join(p.cmdline())
    ]


def shared_memory_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_workers_stop_at_the_end_of_an_epoch_on_break_and_on_close() -> None:
    before, files = {p.pid for p in worker_processes()}, shared_memory_files()
    loader = DataLoader(Pictures(), batch_size=2, num_workers=2)
    list(loader)
    for batch in loader:
        assert len({p.pid for p in worker_processes()} - before) == 2
        break
    del batch
    gc.collect()
    persistent = DataLoader(Pictures(), batch_size=2, num_workers=2, persistent_workers=True)
    list(persistent)
    persistent.close()
    assert {p.pid for p in worker_processes()} - before == set()
    assert shared_memory_files() <= files
