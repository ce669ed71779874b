"""omnifeed.loader.dataloader: the drop-in for torch.utils.data.DataLoader (imports torch)."""

from ._elastic import ElasticBatchSampler
from ._loader import DataLoader

__all__ = [
    "DataLoader",
    "ElasticBatchSampler",
]
