"""omnifeed.trainer_adapter: what a trainer rank uses — `FeedClient` (from the node's service or in-process)."""

from ._client import FeedClient

__all__ = ["FeedClient"]
