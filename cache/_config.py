"""Typed configuration of the cache tiers (documented in docs/config.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RAM_TIER_NAME = r"[A-Za-z0-9_.-]{1,64}"  # it names a file in /dev/shm: no "/"


class RamTierConfig(BaseModel):
    """The node's shared-memory tier: one segment per ``name``, shared by every process that opens it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        default="default",
        pattern=f"^{RAM_TIER_NAME}$",
        description="Segment name; processes that use the same name on a node share one tier.",
    )
    capacity_bytes: int = Field(default=1024 * 2**20, ge=64 * 1024, description="Bytes of entries held, at most.")
    max_entry_fraction: float = Field(
        default=0.125, gt=0, le=0.5, description="An entry larger than this fraction of the capacity is not cached."
    )


class NvmeTierConfig(BaseModel):
    """The node's local-disk tier: an LMDB environment in ``path``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="Local directory of the LMDB environment (created if missing).")
    capacity_bytes: int = Field(default=64 * 2**30, ge=2**20, description="Bytes of entries held, at most.")
    max_map_bytes: int | None = Field(
        default=None,
        ge=2**20,
        description="Largest LMDB map the tier may grow to (default: 4x capacity). When the map cannot grow "
        "further, the tier stops caching with one warning.",
    )


class RemoteTierConfig(BaseModel):
    """Reads from the origin (any fsspec URL): timeouts, retries, and the latency monitor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float | None = Field(
        default=60.0, gt=0, description="One read attempt slower than this fails and is retried."
    )
    retries: int = Field(default=3, ge=0, description="Retries of a read that failed with a transient error.")
    backoff_s: float = Field(default=0.05, ge=0, description="First retry delay, seconds; doubles each retry.")
    latency_window: int = Field(default=256, ge=8, description="Reads in the sliding latency window.")
    latency_percentile: float = Field(default=0.95, gt=0, lt=1, description="Percentile compared with the threshold.")
    degraded_latency_s: float = Field(
        default=0.5, gt=0, description="Storage is flagged degraded while the windowed percentile is above this."
    )
    recover_fraction: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="Degraded clears when the percentile falls below this fraction of the threshold.",
    )
    io_threads: int = Field(default=16, ge=1, description="Reads in flight at once (read-ahead of the feed).")
    degraded_read_ahead: int = Field(
        default=4, ge=1, description="While degraded, the feed admits this many times more micro-batches ahead."
    )


class CacheConfig(BaseModel):
    """The read-through chain: RAM above NVMe above the remote origin; either tier may be left out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ram: RamTierConfig | None = Field(default=None, description="Shared-memory tier; none when absent.")
    nvme: NvmeTierConfig | None = Field(default=None, description="LMDB tier on local disk; none when absent.")
    remote: RemoteTierConfig = Field(default_factory=RemoteTierConfig, description="Origin reads.")
    entries: Literal["raw", "decoded"] = Field(
        default="raw",
        description="Cache the bytes as read (raw), or the decoder's output (decoded: skips decoding on a hit, "
        "several times larger for images).",
    )
    decoded_when_room: bool = Field(
        default=True,
        description="With entries='raw' and a RAM tier: also keep each freshly decoded value (text, image, video, "
        "audio) in the RAM tier while it has free room (an eighth of it is left for raw entries; nothing is evicted "
        "for a decoded entry), so from the second epoch those fields skip decoding. false: raw entries only.",
    )
