"""The trainer side of the batch format: a collated numpy batch as torch tensors sharing its memory.

The feed engine, the decoders and the service work in numpy and never import torch (a
service or a CLI command starts in a fraction of a second without it); this module is imported
only where a batch is handed to a trainer (`Feed.next_batch`, the benchmarks' peer loaders),
and torch is imported by the first call, not by the import.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def to_torch(batch: Any) -> Any:
    """``batch`` with every numpy array replaced by ``torch.from_numpy`` of it (no copy); other values unchanged.

    Dicts, lists and tuples are rebuilt with their converted items; strings, bytes, numbers and
    None stay as they are (``"__key__"``, ``"strings"``, ``"meta"`` of the batch format).
    """
    import torch

    return _converted(batch, torch.from_numpy)


def _converted(value: Any, from_numpy: Any) -> Any:
    if isinstance(value, np.ndarray):
        return from_numpy(value)
    if isinstance(value, dict):
        return {key: _converted(item, from_numpy) for key, item in value.items()}
    if isinstance(value, list):
        return [_converted(item, from_numpy) for item in value]
    if isinstance(value, tuple):
        return tuple(_converted(item, from_numpy) for item in value)
    return value
