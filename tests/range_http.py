"""The HTTP origin of the storage tests: `omnifeed.tools._chaos_storage.RangeServer` (Range support, injectable latency
and errors)."""

from __future__ import annotations

from omnifeed.tools._chaos_storage import RangeServer

__all__ = ["RangeServer"]
