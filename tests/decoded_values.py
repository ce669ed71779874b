"""Decoded values compared exactly: arrays by dtype, shape and bytes, through dicts and lists (the feed tests'
check)."""

from __future__ import annotations

from typing import Any

import numpy as np


def same_values(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same values: arrays bit for bit, dicts by keys, lists and tuples in order."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return bool(a == b)
