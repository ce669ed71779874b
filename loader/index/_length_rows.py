"""The index's derived length files, both optional (an index without them, or with a damaged one, reads the same
values from its Arrow copies):

- ``lengths.npy``: every sample's length columns side by side, one 36-byte record per position, memory-mapped;
- ``even-lengths.npz``: the length columns of `EVEN_SAMPLE` evenly spread rows (`even_positions`), a budget plan's
  bucket probe in one small file instead of a page of every length column.

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
EVEN_LENGTHS = "even-lengths.npz"
EVEN_SAMPLE = 1 << 19  # rows of the stored even sample: a budget plan's default probe


def even_positions(num_samples: int, size: int) -> np.ndarray:
    """``size`` positions spread evenly over ``num_samples`` rows, first and last included (fewer when the index is
    smaller): the sample a budget plan estimates its buckets from."""
    spread = np.linspace(0, num_samples - 1, min(num_samples, size)).astype(np.int64)  # non-decreasing
    return spread[np.r_[True, spread[1:] != spread[:-1]]] if spread.size else spread  # np.unique, without its sort


def length_dtype(columns: dict[str, pa.DataType]) -> np.dtype:
    """The record of one sample: each length column in its own type, in order."""
    return np.dtype([(name, kind.to_pandas_dtype()) for name, kind in columns.items()])


def write_length_files(out: Path, lengths: pa.Table, columns: dict[str, pa.DataType]) -> None:
    """Both derived files of an index in ``out`` from ``lengths`` (its length columns, every row in position order)."""
    records = np.empty(lengths.num_rows, dtype=length_dtype(columns))
    for name in columns:
        records[name] = lengths[name].to_numpy()
    np.save(out / LENGTH_ROWS, records, allow_pickle=False)
    even = records[even_positions(lengths.num_rows, EVEN_SAMPLE)]
    np.savez(out / EVEN_LENGTHS, **{name: np.ascontiguousarray(even[name]) for name in columns})  # type: ignore[arg-type]


def stored_even_lengths(
    root: Path, size: int, rows: int, columns: dict[str, pa.DataType]
) -> dict[str, np.ndarray] | None:
    """``even-lengths.npz`` of the index at ``root`` when it is the even sample of ``size`` (``rows`` rows), whole."""
    path = root / EVEN_LENGTHS
    if size != EVEN_SAMPLE or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            found = {name: stored[name] for name in columns}
    except Exception:  # noqa: BLE001  any damage: the rows hold the same values
        return None
    return found if all(c.shape == (rows,) for c in found.values()) else None


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
