"""`ServiceConfig`: what `omnifeed serve` runs, as validated data (YAML or Python)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ._config import load_yaml
from ._feed_config import FeedConfig


def default_socket() -> str:
    """``$TMPDIR/omnifeed-$UID/feed.sock``: a per-user directory the service creates with mode 0700."""
    return str(Path(tempfile.gettempdir()) / f"omnifeed-{os.getuid()}" / "feed.sock")


class ServiceConfig(BaseModel):
    """The sidecar service: which index it feeds, how (the feed config), where it listens, what it records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: str = Field(description="The index directory (`omnifeed index`); relative to the YAML file's folder.")
    feed: FeedConfig = Field(default_factory=FeedConfig, description="The feed engine: plan, decoding, pools, cache.")
    socket: str = Field(
        default_factory=default_socket,
        description="Unix socket path. Its directory is created with mode 0700 and must belong to this user.",
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="Prometheus endpoint port (0: any free port; null: no endpoint)."
    )
    metrics_host: str = Field(default="127.0.0.1", description="Address the Prometheus endpoint binds.")
    audit_log: str | None = Field(
        default=None, description="Append one JSON line per delivered micro-batch here (what `omnifeed verify` reads)."
    )
    prefetch_batches: int = Field(
        default=4, ge=1, description="Collated batches each stream keeps ready in shared memory ahead of its clients."
    )
    stream_idle_s: float = Field(
        default=30.0, ge=0, description="A stream without clients keeps its prefetched batches this long, then closes."
    )
    max_clients: int = Field(default=256, ge=1, description="Connections served at once; more are refused.")

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServiceConfig:
        """Load from YAML: ``index``, ``feed`` (a feed config), ``socket``, ``metrics_port``, ... (docs/config.md)."""
        data: dict[str, Any] = load_yaml(path)
        folder = Path(path).resolve().parent
        for name in ("index", "audit_log"):
            if isinstance(data.get(name), str) and "://" not in data[name]:
                data[name] = str(folder / data[name])
        return cls(**data)
