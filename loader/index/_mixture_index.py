"""`MixtureIndex`: the indexes of a mixture's sources seen as one index, each filtered on the fly.

A *global position* is a source's offset plus the sample's rank among the samples its filter
keeps, sources in their configured order::

    sources    photos (1,000 kept of 1,000)   docs (612 kept of 2,000: text_tokens in [16, 4096])
    global     0 ........................ 999 1,000 ......................................... 1,611

Keys are ``source/key`` (two sources may both hold ``000001``), so an audit log names the source
of every sample. Everything the feed asks of an index — keys, rows, length columns, shards, the
manifest's tokenizer — is answered by the source that holds the position. A filter is evaluated
once at open over the index's length columns; the samples it removes are counted
(`MixtureIndex.removed`), never silently lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ._sample_index import LENGTH_COLUMNS, IndexedSample, SampleIndex

SOURCE_SEPARATOR = "/"


def filter_positions(index: SampleIndex, where: Mapping[str, tuple[float | None, float | None]]) -> np.ndarray | None:
    """Positions of ``index`` whose columns lie in each ``[low, high]`` of ``where`` (None: no filter, all kept).

    Raises ValueError naming a column the index does not have.
    """
    if not where:
        return None
    keep = np.ones(index.num_samples, dtype=bool)
    for column, (low, high) in where.items():
        if column not in LENGTH_COLUMNS:
            raise ValueError(
                f"{index.path}: a mixture filter names column {column!r}; filter on one of {sorted(LENGTH_COLUMNS)}"
            )
        values = index.column(column)
        if low is not None:
            keep &= values >= low
        if high is not None:
            keep &= values <= high
    return np.flatnonzero(keep).astype(np.int64)


class MixtureIndex:
    """Several source indexes (each optionally filtered) as one read-only index; positions are global."""

    def __init__(self, sources: Sequence[tuple[str, SampleIndex, np.ndarray | None]]) -> None:
        """``sources``: (name, index, the positions its filter keeps or None for all), in the mixture's order.

        Raises ValueError for no source, a source its filter empties, or sources tokenized differently.
        """
        if not sources:
            raise ValueError("a mixture needs at least one source")
        self.names = [name for name, _, _ in sources]
        self.indexes = [index for _, index, _ in sources]
        self.kept = [kept for _, _, kept in sources]
        self.sizes = np.array(
            [index.num_samples if kept is None else kept.size for _, index, kept in sources], dtype=np.int64
        )
        for name, size, index in zip(self.names, self.sizes.tolist(), self.indexes):
            if size == 0:
                raise ValueError(f"mixture source {name!r} ({index.path}): its filter keeps no sample; widen its where")
        tokenizers = {name: index.manifest.get("tokenizer") for name, index in zip(self.names, self.indexes)}
        if len(set(map(str, tokenizers.values()))) > 1:
            raise ValueError(
                f"mixture sources count text tokens differently ({tokenizers}): rebuild them with one tokenizer"
            )
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_samples = int(self.offsets[-1])
        self.removed = {
            name: int(index.num_samples - size) for name, index, size in zip(self.names, self.indexes, self.sizes)
        }
        digest = xxhash.xxh3_64()
        for name, index, kept in sources:
            digest.update(f"{name}\0{index.fingerprint}\0".encode())
            digest.update(b"all" if kept is None else np.ascontiguousarray(kept).tobytes())
        self.fingerprint = f"mixture-{digest.hexdigest()}"
        self.path = Path(f"mixture[{', '.join(self.names)}]")
        first = self.indexes[0].manifest
        self.manifest: dict[str, Any] = {
            **{k: v for k, v in first.items() if k not in ("partitions", "classes")},
            "num_samples": self.num_samples,
            "fingerprint": self.fingerprint,
            "sources": [
                {"name": n, "index": str(i.path), "fingerprint": i.fingerprint, "samples": int(s), "removed": r}
                for n, i, s, r in zip(self.names, self.indexes, self.sizes.tolist(), self.removed.values())
            ],
        }
        self.shards = [shard for index in self.indexes for shard in index.shards]
        self._shard_offsets = np.cumsum([0] + [len(index.shards) for index in self.indexes])

    def __len__(self) -> int:
        return self.num_samples

    @property
    def classes(self) -> list[str]:
        """The sources' class names when they all agree, else none."""
        first = self.indexes[0].classes
        return first if all(index.classes == first for index in self.indexes) else []

    def locate(self, positions: np.ndarray | Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each global position's source (its order in the mixture) and its position in that source's index."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.num_samples):
            raise IndexError(f"positions outside the mixture's {self.num_samples} samples")
        source = np.searchsorted(self.offsets, positions, side="right") - 1
        rank = positions - self.offsets[source]
        local = rank.copy()
        for s, kept in enumerate(self.kept):
            if kept is not None:
                mine = source == s
                local[mine] = kept[rank[mine]]
        return source, local

    def _by_source(self, positions: np.ndarray | Sequence[int]) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(source, where in ``positions``, local positions) per source the positions touch."""
        source, local = self.locate(positions)
        return [(s, np.flatnonzero(source == s), local[source == s]) for s in np.unique(source).tolist()]

    def keys(self, positions: np.ndarray | Sequence[int]) -> list[str]:
        """``source/key`` of each position."""
        out: list[str] = [""] * len(positions)
        for s, where, local in self._by_source(positions):
            for i, key in zip(where.tolist(), self.indexes[s].keys(local)):
                out[i] = f"{self.names[s]}{SOURCE_SEPARATOR}{key}"
        return out

    def length_columns(self, positions: np.ndarray | Sequence[int]) -> dict[str, np.ndarray]:
        """The index's length columns at ``positions`` (every column, empty ones for no position)."""
        if not len(positions):
            return self.indexes[0].length_columns(np.zeros(0, dtype=np.int64))
        pieces = self._by_source(positions)
        out: dict[str, np.ndarray] = {}
        for s, where, local in pieces:
            for name, values in self.indexes[s].length_columns(local).items():
                if name not in out:
                    out[name] = np.zeros(len(positions), dtype=values.dtype)
                out[name][where] = values
        return out

    def column(self, name: str) -> np.ndarray:
        """A whole column over the mixture's samples (kept ones, in global order)."""
        parts = [index.column(name) for index in self.indexes]
        return np.concatenate([p if kept is None else p[kept] for p, kept in zip(parts, self.kept)])

    def sample(self, position: int) -> IndexedSample:
        """Everything the source's index knows about the sample at global ``position``, its key ``source/key``."""
        return self.samples([position])[0]

    def samples(self, positions: np.ndarray | Sequence[int]) -> list[IndexedSample]:
        """`sample` for many positions at once, a take per source."""
        out: list[IndexedSample | None] = [None] * len(positions)
        for s, where, local in self._by_source(positions):
            prefix = f"{self.names[s]}{SOURCE_SEPARATOR}"
            for i, row in zip(where.tolist(), self.indexes[s].samples(local)):
                out[i] = dataclasses.replace(row, position=int(np.asarray(positions)[i]), key=prefix + row.key)
        return out  # type: ignore[return-value]

    def positions_of(self, keys: list[str]) -> np.ndarray:
        """Global positions of ``source/key`` keys (-1 for one no source holds, or its filter removed)."""
        out = np.full(len(keys), -1, dtype=np.int64)
        by_source: dict[int, list[tuple[int, str]]] = {}
        for i, key in enumerate(keys):
            name, _, rest = key.partition(SOURCE_SEPARATOR)
            if name in self.names and rest:
                by_source.setdefault(self.names.index(name), []).append((i, rest))
        for s, wanted in by_source.items():
            local = self.indexes[s].positions_of([k for _, k in wanted])
            kept = self.kept[s]
            if kept is None:
                rank = local
            else:
                at = np.searchsorted(kept, local)
                found = (local >= 0) & (at < kept.size) & (kept[np.minimum(at, kept.size - 1)] == local)
                rank = np.where(found, at, -1)
            for (i, _), r in zip(wanted, rank.tolist()):
                out[i] = self.offsets[s] + r if r >= 0 else -1
        return out
