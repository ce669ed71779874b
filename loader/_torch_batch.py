"""The trainer side of the batch format: a collated numpy batch as torch tensors sharing its memory.

The feed engine, the decoders and the service work in numpy and never import torch (a
service or a CLI command starts in a fraction of a second without it); this module is imported
only where a batch is handed to a trainer (`Feed.next_batch`, the benchmarks' peer loaders),
and it is the one place that imports torch for that.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_torch(batch: Any) -> Any:
    """``batch`` with every numpy array replaced by ``torch.from_numpy`` of it (no copy); other values unchanged.

    Dicts, lists and tuples are rebuilt with their converted items; strings, bytes, numbers and
    None stay as they are (``"__key__"``, ``"strings"``, ``"meta"`` of the batch format).
    """
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch)
    if isinstance(batch, dict):
        return {key: to_torch(value) for key, value in batch.items()}
    if isinstance(batch, list):
        return [to_torch(value) for value in batch]
    if isinstance(batch, tuple):
        return tuple(to_torch(value) for value in batch)
    return batch
