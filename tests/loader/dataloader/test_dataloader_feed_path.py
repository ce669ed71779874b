"""The index path: DataLoader(index, feed_config=...) is the feed behind torch's DataLoader surface."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.utils.data as tud

from omnifeed.loader import DataLoader, Feed, FeedConfig, PlanConfig, SampleIndex

pytestmark = pytest.mark.timeout(240)


def config() -> FeedConfig:
    return FeedConfig(plan=PlanConfig(seed=5, batch_size=4))


def keys(batches: list[dict]) -> list[list[str]]:
    return [b["__key__"] for b in batches]


def test_index_loader_yields_the_feeds_batches_with_state_and_resize(index_dir: Path) -> None:
    with Feed(index_dir, config(), world_size=2, rank=1) as feed:
        expected = keys(list(feed))
    with DataLoader(index_dir, feed_config=config(), world_size=2, rank=1) as loader:
        assert isinstance(loader, tud.DataLoader) and isinstance(loader.dataset, SampleIndex)
        assert (loader.batch_size, loader.drop_last, loader.num_workers) == (4, False, 0)
        assert len(loader) == len(expected) == 6  # 48 samples, 12 micro-batches over 2 ranks
        iterator = iter(loader)
        head = [next(iterator) for _ in range(2)]
        assert head[0]["__info__"]["rank"] == 1 and isinstance(head[0]["text"]["tokens"], torch.Tensor)
        state = loader.state_dict()
        assert len(loader) == 4
    with DataLoader(SampleIndex(index_dir), feed_config=config(), world_size=2, rank=1) as resumed:
        resumed.load_state_dict(state)
        assert keys(head) + keys(list(resumed)) == expected
        resumed.resize(3, 0)
        assert resumed.metrics()["batches"] == 4


def test_index_loader_refuses_torch_batching_arguments(index_dir: Path) -> None:
    with pytest.raises(ValueError, match="drop batch_size, num_workers from the DataLoader call"):
        DataLoader(index_dir, feed_config=config(), batch_size=8, num_workers=2)
    with pytest.raises(ValueError, match="give both world_size= and rank="):
        DataLoader(index_dir, feed_config=config(), world_size=2)
    loader = DataLoader(index_dir, feed_config=config())
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        loader.batch_size = 2
    loader.close()
