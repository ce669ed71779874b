"""``lengths.npy``: every sample's length columns side by side, one 36-byte record per position, memory-mapped.

A budget plan reads the lengths of a window's samples, ~179,000 positions spread over the whole
index. From the Arrow copies that touches a page of each of the nine length columns per sample;
from these records, one page per sample (benchmarks/RESULTS.md, "A billion-row index"). Derived
from the rows when the index is written, and optional: an index without it (or with a damaged one)
reads its Arrow copies instead, the same values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

LENGTH_ROWS = "lengths.npy"


def length_dtype(columns: dict[str, pa.DataType]) -> np.dtype:
    """The record of one sample: each length column in its own type, in order."""
    return np.dtype([(name, kind.to_pandas_dtype()) for name, kind in columns.items()])


def write_length_rows(path: Path, lengths: pa.Table, columns: dict[str, pa.DataType]) -> None:
    """Every row of ``lengths`` (the index's length columns, in position order) as records at ``path``."""
    records = np.empty(lengths.num_rows, dtype=length_dtype(columns))
    for name in columns:
        records[name] = lengths[name].to_numpy()
    np.save(path, records, allow_pickle=False)


class LengthRows:
    """The mapped records of an index's ``lengths.npy``, or None from `open` when it has none that fits."""

    def __init__(self, records: np.ndarray) -> None:
        self._records = records

    @classmethod
    def open(cls, path: Path, num_samples: int, columns: dict[str, pa.DataType]) -> LengthRows | None:
        """The records at ``path`` when present, readable and of ``num_samples`` records of the expected type."""
        if not path.is_file():
            return None
        try:
            records = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception:  # noqa: BLE001  any damage: the Arrow copies hold the same values
            return None
        if records.shape != (num_samples,) or records.dtype != length_dtype(columns):
            return None
        return cls(records)

    def columns(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The length columns at ``positions`` (read in position order: neighbouring samples share a page)."""
        order = np.argsort(positions, kind="stable")
        taken = np.empty(positions.size, dtype=self._records.dtype)
        taken[order] = self._records[positions[order]]
        return {name: np.ascontiguousarray(taken[name]) for name in taken.dtype.names or ()}
