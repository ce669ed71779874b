"""One sample's record from its fields, whatever the source: fields checked, lengths probed, content digested."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from .._errors import SourceError
from ._probe import probe_lengths
from ._records import FieldLocation, ScannedSample
from ._tokenizers import TokenCounter

Items = list[tuple[FieldLocation, bytes]]
"""A sample's fields so far: location and bytes."""


def sample_digest(fields: Iterable[tuple[str, bytes]]) -> int:
    """xxh64 (unsigned 64-bit) of a sample's fields in name order: name, NUL, 8-byte length, bytes."""
    digest = xxhash.xxh64()
    for name, data in sorted(fields, key=lambda item: item[0]):
        digest.update(name.encode("utf-8") + b"\0" + len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.intdigest()


def make_sample(url: str, key: str, items: Items, count: TokenCounter, rg: int = -1, row: int = -1) -> ScannedSample:
    """Probe lengths and digest of one sample's fields (sorted by name in place).

    Raises ``FieldProbeError`` (``_probe``) naming the field that cannot be probed.
    """
    items.sort(key=lambda item: item[0].name)
    lengths = probe_lengths(items, count, url=url, key=key)
    digest = sample_digest((location.name, data) for location, data in items)
    return ScannedSample(key, tuple(location for location, _ in items), lengths, digest, rg, row)


class FieldTwice(SourceError):
    """Two fields of one sample with the same (lower-cased) name."""


def add_field(url: str, key: str, items: Items, location: FieldLocation, data: bytes) -> None:
    """Append one field to a sample's ``items``; FieldTwice when the sample has that field already."""
    if any(other.name == location.name for other, _ in items):
        raise FieldTwice(
            f"{url}: sample {key!r} has field {location.name!r} twice (names are lower-cased); "
            "rename or remove one of them",
            url=url,
            key=key,
        )
    items.append((location, data))
