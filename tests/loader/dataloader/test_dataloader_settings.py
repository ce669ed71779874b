"""An iterator takes the loader's settings as they are when it is made, never the loader itself."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch.utils.data as tud

from omnifeed.loader import DataLoader

LOADERS = [pytest.param(tud.DataLoader, id="torch"), pytest.param(DataLoader, id="omnifeed")]
pytestmark = pytest.mark.timeout(120)


def _tag(tag: str) -> Any:
    return lambda batch: (tag, batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_does_not_keep_its_loader_alive(workers: int) -> None:
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=workers)
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    gone = weakref.ref(loader)
    del loader
    gc.collect()
    assert gone() is None
    assert [b.tolist() for b in iterator] == [[2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("cls", LOADERS)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_changed_attribute_applies_to_the_next_iterator_not_the_running_one(cls: Any, workers: int) -> None:
    loader = cls(list(range(4)), batch_size=2, num_workers=workers, collate_fn=_tag("a"))
    running = iter(loader)
    loader.collate_fn = _tag("b")
    assert [tag for tag, _ in running] == ["a", "a"]
    assert [tag for tag, _ in loader] == ["b", "b"]


@pytest.mark.parametrize("cls", LOADERS)
def test_persistent_workers_keep_the_settings_they_started_with(cls: Any) -> None:
    loader = cls(list(range(4)), batch_size=2, num_workers=1, persistent_workers=True, collate_fn=_tag("a"))
    assert [tag for tag, _ in loader] == ["a", "a"]
    loader.collate_fn = _tag("b")
    assert [tag for tag, _ in loader] == ["a", "a"]
