"""`FeedConfig`: everything the feed engine needs besides the index, as validated data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ._config import PlanConfig, load_yaml
from ._decode_config import DecodeConfig

FEED_MODALITIES = ("text", "image", "video", "audio", "meta")


class PoolConfig(BaseModel):
    """One modality's decode workers and its bounded ready buffer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: int = Field(default=1, ge=0, description="Threads dedicated to this modality.")
    processes: int = Field(
        default=0, ge=0,
        description="Worker processes that decode this modality (0: decode in the threads). For decoders that "
        "hold the GIL; the threads then only hand tasks to the processes and wait, so give twice as many "
        "threads as processes to keep them busy.",
    )
    buffer_samples: int = Field(default=256, ge=1, description="Samples of this modality decoded ahead, at most.")
    buffer_bytes: int = Field(default=512 * 2**20, ge=1, description="Bytes of decoded output held ahead, at most.")


def _default_pools() -> dict[str, PoolConfig]:
    return {
        "text": PoolConfig(workers=1, buffer_samples=1024),
        "image": PoolConfig(workers=2, buffer_samples=256),
        "video": PoolConfig(workers=1, buffer_samples=16, buffer_bytes=1024 * 2**20),
        "audio": PoolConfig(workers=1, buffer_samples=64),
        "meta": PoolConfig(workers=0, buffer_samples=1024),
    }


class FeedConfig(BaseModel):
    """The feed: which micro-batches (plan), how fields decode, and the pools that decode them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    plan: PlanConfig = Field(default_factory=PlanConfig, description="The micro-batch sequence.")
    decode: DecodeConfig = Field(default_factory=DecodeConfig, description="Per-modality decoding.")
    pools: dict[str, PoolConfig] = Field(default_factory=_default_pools, description="Per-modality pools.")
    shared_workers: int = Field(
        default=1, ge=0, description="Threads that serve whichever modality's buffer is emptiest (by fill fraction)."
    )
    prefetch_steps: int = Field(default=4, ge=1, description="Steps of this rank planned and queued ahead.")
    retries: int = Field(default=3, ge=0, description="Retries of a read that failed with a transient error.")
    retry_backoff_s: float = Field(default=0.05, ge=0, description="First retry delay, seconds; doubles each retry.")
    error_budget: float = Field(
        default=0.01, ge=0, le=1, description="Fraction of samples that may fail before the feed stops with an error."
    )
    error_budget_min_samples: int = Field(
        default=200, ge=1, description="Samples read before the error budget is enforced."
    )

    def pool(self, modality: str) -> PoolConfig:
        """The pool configuration of ``modality`` (a default one when not configured)."""
        return self.pools.get(modality) or _default_pools().get(modality, PoolConfig())

    @classmethod
    def from_yaml(cls, path: str | Path) -> FeedConfig:
        """Load a feed config from YAML: top-level ``plan``, ``decode``, ``pools``, ... (see docs/config.md)."""
        data: dict[str, Any] = load_yaml(path)
        data.pop("index", None)  # the same file may configure `omnifeed index`
        return cls(**data)
