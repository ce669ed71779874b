"""omnifeed.trainer_adapter: what a trainer rank uses — `FeedClient` (from the node's service or in-process), resize
hints."""

from ._client import FeedClient
from ._hints import TopologyHints, scale_learning_rate, topology_hints

__all__ = ["FeedClient", "TopologyHints", "scale_learning_rate", "topology_hints"]
