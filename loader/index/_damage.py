"""Damage costs one sample: a sample that cannot be indexed is left out and named, the rest of its shard indexed.

A scan records each damaged sample (``DamagedSample``: file, key, member, reason, the one-line
error) in a `Damage` collector instead of refusing the shard; the build reports every one
(``IndexReport.damaged``, the manifest's ``damaged`` entry, the CLI's output and exit status 3).
With ``IndexConfig.strict`` the first damage refuses the whole shard instead (SourceError), as
every damage did before issue 18.

| reason | what | left out |
|---|---|---|
| ``header`` | an image, audio or video header that cannot be read | the sample |
| ``bomb`` | an image header declaring more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels | the sample |
| ``encoding`` | a text field that is not UTF-8 | the sample |
| ``field_twice`` | two members of one sample with the same (lower-cased) field name | the sample |
| ``not_adjacent`` | a key's members appearing again after other samples | the later members (the first run is kept, as WebDataset reads it) |
| ``no_bytes`` | a Parquet/Arrow media cell holding a path but no bytes, whose file cannot be read beneath ``IndexConfig.media_root`` (without a root the file is refused) | the row |
| ``truncated`` | a tar unreadable past a point: a corrupt header, a member past the end, no end marker | the sample being read and the rest of the shard |
| ``sparse`` | a GNU sparse tar member (it cannot be read back by offset) | the sample being read and the rest of the shard |
| ``oversized_header`` | a tar extended header declaring more than 1 MiB | the sample being read and the rest of the shard |

Refused as a whole shard, strict or not (they say the shard itself is wrong, not one sample
in it): a member name escaping its root or not UTF-8, a compressed tar, an unreadable first
header, Parquet key problems (a missing named key column, a null or repeated key), a column
whose values cannot be converted, a folder's link loops and links leading outside. A shard none
of whose samples could be indexed is refused too (`ShardDamaged`), its damaged samples still listed.
"""  # noqa: E501 (Markdown table rows cannot wrap)

from __future__ import annotations

import logging

from .._errors import SourceError
from ._records import DamagedSample, ShardScan

log = logging.getLogger(__name__)

DAMAGED_FILE = "damaged.jsonl"
"""The full list of damaged samples in the index folder (one JSON object a line), when the manifest's is cut."""
MANIFEST_LIST_MAX = 100
"""Damaged samples listed in the manifest itself; more go to ``DAMAGED_FILE``."""

REASONS = (
    "header",
    "bomb",
    "encoding",
    "field_twice",
    "not_adjacent",
    "no_bytes",
    "truncated",
    "sparse",
    "oversized_header",
)


def damage_summary(damaged: list[dict[str, str]]) -> dict[str, object]:
    """The manifest's ``damaged`` entry: count, count by reason, the first ``MANIFEST_LIST_MAX`` samples, and
    the name of the file holding them all when there are more."""
    by_reason: dict[str, int] = {}
    for entry in damaged:
        by_reason[entry["reason"]] = by_reason.get(entry["reason"], 0) + 1
    summary: dict[str, object] = {
        "count": len(damaged),
        "by_reason": dict(sorted(by_reason.items())),
        "samples": damaged[:MANIFEST_LIST_MAX],
    }
    if len(damaged) > MANIFEST_LIST_MAX:
        summary["file"] = DAMAGED_FILE
    return summary


class ShardDamaged(SourceError):
    """Every sample of a shard is damaged: the shard is refused, ``damaged`` lists them all."""

    def __init__(self, message: str, *, url: str, key: str | None, damaged: list[DamagedSample]) -> None:
        super().__init__(message, url=url, key=key)
        self.damaged = damaged


class Damage:
    """The damaged samples of one shard scan; with ``strict``, the first one refuses the shard."""

    def __init__(self, url: str, strict: bool) -> None:
        self.url = url
        self.strict = strict
        self.samples: list[DamagedSample] = []

    def add(self, key: str, member: str, reason: str, error: str, left_out: str = "") -> None:
        """Record one damaged sample; ``left_out`` is appended to ``error`` (what else is left out).

        Raises SourceError(``error``) instead when strict.
        """
        assert reason in REASONS, reason
        if self.strict:
            raise SourceError(error, url=self.url, key=key or None)
        message = f"{error}; {left_out}" if left_out else error
        log.debug("damaged: %s", message)
        self.samples.append(DamagedSample(self.url, key, member, reason, message))

    def finish(self, scan: ShardScan) -> ShardScan:
        """``scan`` with the damaged samples; ShardDamaged when damage left no sample at all."""
        scan.damaged = self.samples
        if not scan.samples and self.samples:
            first, more = self.samples[0], len(self.samples) - 1
            others = f" (and {more} more damaged sample{'s' if more > 1 else ''})" if more else ""
            raise ShardDamaged(
                f"{self.url}: no sample could be indexed, every one is damaged{others}; the first: {first.error}",
                url=self.url,
                key=first.key or None,
                damaged=self.samples,
            )
        return scan
