"""`DeliveryPath`: what the drop-in ``DataLoader`` delegates to the path it chose at construction.

One implementation per path: ``TorchPath`` (``_torch_path``: a user dataset through omnifeed's resumable
iterators), ``TorchIterators`` (the same, for DataPipes: torch's own iterators, no state), ``ElasticPath``
(``_elastic_path``: ``world_size=``/``rank=``, an ``ElasticBatchSampler``) and ``FeedPath`` (``_feed_path``:
an omnifeed index behind torch's surface). The loader passes itself to every call (a path keeps no reference
to it, so a loader is freed as soon as it is unreachable, as torch's is) and branches on none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class DeliveryPath(Protocol):
    """The operations of ``DataLoader`` that depend on where its batches come from."""

    def iterate(self, loader: Any) -> Any:
        """``iter(loader)``: an iterator over the batches of the next (or resumed) epoch."""

    def new_iterator(self, loader: Any, resume: Any = None) -> Any:
        """``loader._get_iterator(resume)``: a new iterator, continuing ``resume`` when given."""

    def length(self, loader: Any) -> int:
        """``len(loader)``."""

    def state_dict(self, loader: Any) -> dict[str, Any]:
        """``loader.state_dict()``."""

    def load_state_dict(self, loader: Any, state: Mapping[str, Any]) -> None:
        """``loader.load_state_dict(state)``."""

    def resize(self, loader: Any, world_size: int, rank: int) -> None:
        """``loader.resize(world_size, rank)``."""

    def metrics(self) -> dict[str, Any]:
        """``loader.metrics()``."""

    def close(self, loader: Any) -> None:
        """``loader.close()``."""
