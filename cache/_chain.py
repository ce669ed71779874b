"""The read-through chain: RAM → NVMe → origin; a miss fills the tiers above the one that had it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from ._config import CacheConfig
from ._errors import CacheError
from ._nvme import NvmeTier
from ._ram import RamTier
from ._remote import RemoteTier

log = logging.getLogger(__name__)


class CacheTier(Protocol):
    """What the chain needs of a tier."""

    def get(self, key: bytes) -> bytes | None: ...
    def put(self, key: bytes, value: bytes, *, accessed: bool = True) -> bool: ...
    def contains(self, key: bytes) -> bool: ...
    def discard(self, key: bytes) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class CacheChain:
    """Tiers from fastest to slowest, above the remote origin."""

    def __init__(self, config: CacheConfig | None = None) -> None:
        self.config = config or CacheConfig()
        self.tiers: dict[str, CacheTier] = {}
        if self.config.ram is not None:
            try:
                self.tiers["ram"] = RamTier(self.config.ram)
            except CacheError as exc:  # reads still work without it
                log.warning("running without the RAM tier: %s", exc)
        if self.config.nvme is not None:
            try:
                self.tiers["nvme"] = NvmeTier(self.config.nvme)
            except CacheError as exc:  # another user's directory, or one open to others: reads still work
                log.warning("running without the NVMe tier: %s", exc)
        self.remote = RemoteTier(self.config.remote)

    def get(self, key: bytes, fetch: Callable[[], bytes]) -> bytes:
        """The entry from the first tier that has it, else ``fetch()`` (the origin); either way the tiers above fill."""
        value = self.lookup(key)
        if value is None:
            value = fetch()
            self.store(key, value)
        return value

    def lookup(self, key: bytes) -> bytes | None:
        """The entry from the first tier that has it (filling the tiers above), or None."""
        missed: list[CacheTier] = []
        for tier in self.tiers.values():
            value = tier.get(key)
            if value is not None:
                for upper in missed:
                    upper.put(key, value)
                return value
            missed.append(tier)
        return None

    def store(self, key: bytes, value: bytes, *, accessed: bool = True) -> None:
        """Offer an entry to every tier (each applies its own bound and admission)."""
        for tier in self.tiers.values():
            tier.put(key, value, accessed=accessed)

    def discard(self, key: bytes) -> None:
        """Forget an entry in every tier (a reader found it unusable: the next ``store`` replaces it)."""
        for tier in self.tiers.values():
            tier.discard(key)

    def stats(self) -> dict[str, Any]:
        """Per tier: hits, misses, bytes, occupancy; and the origin's reads and latency."""
        return {**{name: tier.stats() for name, tier in self.tiers.items()}, "remote": self.remote.stats()}

    def close(self) -> None:
        """Close every tier (idempotent)."""
        for tier in self.tiers.values():
            tier.close()
        self.remote.close()

    def __enter__(self) -> CacheChain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
