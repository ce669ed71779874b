"""`ServiceConfig`: what `omnifeed serve` runs, as validated data (YAML or Python)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .._config import load_yaml, validated
from .._config_paths import SERVICE_PATHS, resolve_paths
from ..feed import FeedConfig


def default_socket() -> str:
    """``$TMPDIR/omnifeed-$UID/feed.sock``: a per-user directory the service creates with mode 0700."""
    return str(Path(tempfile.gettempdir()) / f"omnifeed-{os.getuid()}" / "feed.sock")


class ServiceConfig(BaseModel):
    """The sidecar service: which index it feeds, how (the feed config), where it listens, what it records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: str | None = Field(
        default=None,
        description="The index directory (`omnifeed index`); a relative path in YAML is relative to "
        "the YAML file's folder, as every path of the file is. None: the sources of feed.plan.mixture.",
    )
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
    switch_interval_s: float | None = Field(
        default=0.0005,
        gt=0,
        description="The interpreter's thread switch interval (sys.setswitchinterval) in the service's process while "
        "it runs; null: Python's own (5 ms). One interpreter lock serves every rank's decode threads, which drop and "
        "retake it for each chunk or frame they decode: at 5 ms a thread that wants it back waits behind any Python "
        "running, and the node's production fell to 0.7x two in-process feeds (benchmarks/RESULTS.md, issue 29).",
    )
    producers: Literal["auto", "threads", "processes"] = Field(
        default="auto",
        description="Where each data-parallel stream decodes and collates its batches: `processes`, a process of its "
        "own per stream, with the feed's decode workers (as that rank's in-process Feed would have; the RAM and NVMe "
        "tiers stay the node's); `threads`, in the service's process on decode workers every stream shares (one "
        "interpreter lock for the node: 0.72-0.79x two in-process feeds for two ranks); `auto`, processes unless a "
        "modality decodes on Ray (executor: ray), whose actors are the service's, or the service runs in a daemonic "
        "process. docs/service.md, 'Producers'.",
    )
    producer_cpus: Literal["split", "any"] = Field(
        default="split",
        description="Where the producer processes run (producers: processes): `split`, each on a window of its own of "
        "the CPUs the service may use (its affinity, so a cgroup or taskset limit holds), windows re-divided as "
        "streams start and stop, adjacent ones sharing a CPU where the division is not exact; a producer's decode "
        "threads then take turns at its interpreter lock on its own cores instead of being preempted by the other "
        "producers' on every core (less CPU a sample: benchmarks/RESULTS.md, issue 29); where the feed config leaves "
        "pools and shared_workers unset, each decodes on one thread a CPU of its window (shared_workers: cpus); `any`: "
        "wherever the OS puts them, with the feed config's workers.",
    )
    stream_idle_s: float = Field(
        default=30.0, ge=0, description="A stream without clients keeps its prefetched batches this long, then closes."
    )
    max_clients: int = Field(default=256, ge=1, description="Connections served at once; more are refused.")
    idle_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A connection that sends no request for this long is closed (error `idle`; "
        "a FeedClient reconnects where it was).",
    )
    frame_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A new connection must send its first request within this, and a request "
        "once begun must arrive whole within this (and a reply be taken); else the connection is closed.",
    )
    max_micro_batches_per_step: int = Field(
        default=65536,
        ge=1,
        description="A hello whose data-parallel size × gradient accumulation (the micro-batches "
        "a step deals) is larger is refused (error `topology`), as is one larger than an epoch of the plan.",
    )
    max_micro_batches_dealt: int = Field(
        default=16 * 65536,
        ge=1,
        description="The micro-batches all streams' steps deal together (each stream deals "
        "its whole step); a new stream past it closes streams without clients, else its hello gets `busy`.",
    )

    @model_validator(mode="after")
    def _an_index_or_a_mixture(self) -> ServiceConfig:
        if self.index is None and self.feed.plan.mixture is None:
            raise ValueError("give the service an index (its directory), or feed.plan.mixture with its sources")
        if self.index is not None and self.feed.plan.mixture is not None:
            raise ValueError("feed.plan.mixture names the indexes it reads: drop index (or the mixture)")
        return self

    @model_validator(mode="after")
    def _ray_actors_are_the_services(self) -> ServiceConfig:
        if self.producers == "processes" and self._ray_modalities():
            raise ValueError(
                f"producers: processes cannot decode {', '.join(self._ray_modalities())} on Ray (executor: ray): the "
                "actors are the service's; set producers: threads (or auto)"
            )
        return self

    def _ray_modalities(self) -> list[str]:
        return sorted(m for m, pool in self.feed.pools.items() if pool.executor == "ray")

    @property
    def producer_processes(self) -> bool:
        """Whether each stream makes its batches in a process of its own (``producers``, ``auto`` resolved)."""
        return self.producers == "processes" or (self.producers == "auto" and not self._ray_modalities())

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServiceConfig:
        """Load from YAML: ``index``, ``feed`` (a feed config), ``socket``, ``metrics_port``, ... (docs/config.md)."""
        return validated(cls, resolve_paths(load_yaml(path), Path(path), SERVICE_PATHS), source=path)
