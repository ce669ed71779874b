"""Where a field's bytes come from: the cache chain (RAM → NVMe), else the origin through the remote tier.

Entries are keyed by (index fingerprint, sample key, field, transform version): ``raw`` for
the stored bytes, or a digest of the modality's decode settings for decoded entries, so a
re-indexed source or a changed resize never meets an old entry. A decoded entry holds the
decoder's output before any transform step (`_transforms`: they are random per epoch, so
none is cached and none is in the key); a field or modality with a user's decoder has no
decoded entries (its function has no version to key by).

With ``entries='raw'`` and ``decoded_when_room`` (the default), a feed with a RAM tier also
keeps each freshly decoded value of a text, image, video or audio field in that tier while it
has free room (`_AUTO_FREE_SHARE` of it stays free for raw entries; a decoded entry never
evicts), and looks there first: from the second epoch such fields skip decoding.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import Any, Literal

import xxhash

from ...cache import CacheChain, CacheConfig, entry_key
from .._modalities import MODALITIES
from ..decode import ColumnKind, DecodeConfig
from ..index import FieldLocation, IndexedSample, column_kinds, read_field
from ._decoded_codec import DecodedEntryError, decode_decoded, encode_decoded, tensor_bytes
from ._field_decoders import field_keys, matching_field

log = logging.getLogger(__name__)

DECODED_FORMAT = "omnifeed.decoded/1"  # bump when a decoder's output changes for the same settings
RAW = "raw"
_AUTO_FREE_SHARE = 8  # with decoded_when_room: decoded entries stop when less than 1/8 of the RAM tier is free

Loaded = tuple[Literal["raw", "decoded"], Any]
"""("raw", bytes as stored) or ("decoded", the decoder's output from a decoded entry)."""


def transform_version(modality: str, decode: DecodeConfig) -> str:
    """The version tag of decoded entries of ``modality`` under ``decode``."""
    settings = getattr(decode, modality).model_dump_json()
    return xxhash.xxh3_64_hexdigest(f"{DECODED_FORMAT}|{modality}|{settings}".encode())


class FieldSource:
    """Loads fields through the cache chain; stores decoded values when entries are decoded."""

    def __init__(
        self, config: CacheConfig, namespace: str, decode: DecodeConfig, custom: frozenset[str] = frozenset()
    ) -> None:
        self.config, self.namespace = config, namespace
        self.chain = CacheChain(config)
        # decoded entries for the built-in decoders only: a user's decoder has no version to key by
        self._versions = {m: transform_version(m, decode) for m in MODALITIES if m not in custom}
        self._custom_fields = field_keys(custom)
        self._decoded = config.entries == "decoded"
        # entries='raw': decoded values too, in the RAM tier while it has room (none from a user's decoder)
        self._ram = self.chain.tiers.get("ram") if not self._decoded and config.decoded_when_room else None
        self._columns: dict[str, dict[str, ColumnKind]] = {}  # Parquet/Arrow URL -> column -> how its cells are stored
        self._columns_lock = threading.Lock()

    def raw_key(self, sample: IndexedSample, location: FieldLocation) -> bytes:
        """Cache key of the field's stored bytes."""
        return entry_key(self.namespace, sample.key, location.name, RAW)

    def decoded_key(self, sample: IndexedSample, location: FieldLocation) -> bytes | None:
        """Cache key of the field's decoded value, or None when decoded values are not cached for it."""
        version = self._versions.get(location.modality) if self._decoded or self._ram is not None else None
        if version is not None and self._custom_fields and matching_field(location.name, self._custom_fields):
            version = None
        return None if version is None else entry_key(self.namespace, sample.key, location.name, version)

    def origin(self, sample: IndexedSample, location: FieldLocation) -> bytes:
        """The field's bytes from its source (ranged read), through the remote tier's timeout, retries and monitor."""
        reader = functools.partial(read_field, sample.shard, location, row_group=sample.row_group, row=sample.row)
        return self.chain.remote.read(sample.shard.url, reader)

    def load(self, sample: IndexedSample, location: FieldLocation) -> Loaded:
        """The decoded entry if one is cached, else the raw bytes (from a tier, or the origin filling the tiers)."""
        key = self.decoded_key(sample, location)
        if key is not None and self._ram is not None:  # decoded when there was room, else raw
            entry = self._ram.get(key, count_miss=False)  # a miss: the raw lookup counts the access
            if entry is not None:
                try:
                    return "decoded", decode_decoded(entry)
                except DecodedEntryError as exc:
                    log.warning(
                        "cached decoded entry of %r field %r is unreadable (%s)", sample.key, location.name, exc
                    )
                    self._ram.discard(key)
            return "raw", self.chain.get(self.raw_key(sample, location), lambda: self.origin(sample, location))
        if key is not None:
            entry = self.chain.lookup(key)
            if entry is not None:
                try:
                    return "decoded", decode_decoded(entry)
                except DecodedEntryError as exc:
                    log.warning(
                        "cached decoded entry of %r field %r is unreadable (%s): decoding again",
                        sample.key,
                        location.name,
                        exc,
                    )
                    self.chain.discard(key)  # so the value decoded again replaces it
            return "raw", self.origin(sample, location)
        if not self.chain.tiers:
            return "raw", self.origin(sample, location)
        return "raw", self.chain.get(self.raw_key(sample, location), lambda: self.origin(sample, location))

    def remember(self, sample: IndexedSample, location: FieldLocation, value: Any) -> None:
        """Cache a freshly decoded value (decoded entries, or the RAM tier while it has room)."""
        key = self.decoded_key(sample, location)
        if key is None:
            return
        if self._ram is None:
            if self.chain.tiers:
                self.chain.store(key, encode_decoded(value))
            return
        stats = self._ram.stats()
        free = stats["capacity_bytes"] - stats["bytes_used"] - stats["capacity_bytes"] // _AUTO_FREE_SHARE
        if tensor_bytes(value) + 4096 <= free:  # + the entry's header and layout, generously
            self._ram.put(key, encode_decoded(value), accessed=False)

    def column_kind(self, sample: IndexedSample, location: FieldLocation) -> ColumnKind | None:
        """How the index stored a Parquet or Arrow cell ('binary', 'string' or 'json'); None for other sources.

        From the file's schema, read once per file (its footer or first message, through the remote tier's retries).
        """
        if sample.shard.kind not in ("parquet", "arrow"):
            return None
        url = sample.shard.url
        with self._columns_lock:
            kinds = self._columns.get(url)
        if kinds is None:
            kinds = json.loads(self.chain.remote.read(url, functools.partial(_column_kinds, url, sample.shard.kind)))
            with self._columns_lock:
                if len(self._columns) >= 4096:
                    self._columns.clear()
                self._columns[url] = kinds
        return kinds.get(location.member, "binary")

    @property
    def degraded(self) -> bool:
        """Whether the origin's read latency is over its threshold now."""
        return self.chain.remote.degraded

    def stats(self) -> dict[str, Any]:
        """Per-tier statistics of the chain."""
        return self.chain.stats()

    def close(self) -> None:
        """Close the chain (idempotent)."""
        self.chain.close()


def _column_kinds(url: str, kind: Any) -> bytes:
    """The kind of each column of the Parquet or Arrow file at ``url``, as JSON bytes (the remote tier's reader's)."""
    return json.dumps(column_kinds(url, kind)).encode()
