"""`RemoteConfig`: one modality's decode workers as Ray actors (``pools.<modality>.remote``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RemoteConfig(BaseModel):
    """Decode workers of one modality as Ray actors on a cluster, next to the pool's local workers.

    See docs/service.md, "Decoding on a Ray cluster".
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: int = Field(default=2, ge=1, description="Actors started (and the fewest kept when the pool shrinks).")
    max_workers: int | None = Field(
        default=None,
        ge=1,
        description="Actors at most: more are started while the modality starves (its tasks wait and every actor "
        "is busy), fewer when they idle. Null: ``workers``, a fixed pool.",
    )
    address: str = Field(
        default="auto",
        description="The Ray cluster: auto (the one this machine belongs to), HOST:PORT, or ray://HOST:PORT "
        "(Ray client). A connection this process already holds is used as it is.",
    )
    tasks_per_worker: int = Field(
        default=2, ge=1, description="Tasks sent to one actor at a time (one decodes while the next travels)."
    )
    num_cpus: float = Field(default=1.0, gt=0, description="CPUs Ray reserves for each actor.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each actor needs (e.g. {decode: 1} to keep actors off the service's node).",
    )
    deadline_s: float = Field(
        default=10.0,
        gt=0,
        description="A task an actor has not answered within this is decoded locally (the first result wins); "
        "the actor takes no task until it answers, and is replaced if it has not within three times this.",
    )
    send_bytes: bool = Field(
        default=False,
        description="Read the field on the service's node (its cache chain) and send the bytes: for actors that "
        "cannot reach the origin. False: the actor reads it through its own chain (no RAM tier).",
    )
    retry_s: float = Field(default=10.0, gt=0, description="While the cluster is unreachable, try again this often.")
    grow_after_s: float = Field(
        default=2.0,
        gt=0,
        description="Starved this long without a break (tasks queued, at least 75 % of the "
        "remote slots busy): one more actor, up to ``max_workers``.",
    )
    shrink_after_s: float = Field(
        default=30.0, gt=0, description="No remote slot busy for this long: one actor fewer, down to ``workers``."
    )

    @model_validator(mode="after")
    def _cap_holds_the_floor(self) -> RemoteConfig:
        if self.max_workers is not None and self.max_workers < self.workers:
            raise ValueError(f"remote.max_workers ({self.max_workers}) is below remote.workers ({self.workers})")
        return self

    @property
    def cap(self) -> int:
        """The most actors this modality may run."""
        return self.max_workers or self.workers


def check_remote_pools(pools: Mapping[str, Any]) -> None:
    """Remote pools are for decoded media and text, and share one cluster; raises ValueError otherwise."""
    remote = {m: p.remote for m, p in pools.items() if getattr(p, "remote", None) is not None}
    if "meta" in remote:
        raise ValueError("pools.meta.remote: meta fields decode in the service (they are small values), not on Ray")
    addresses = {r.address for r in remote.values()}
    if len(addresses) > 1:
        raise ValueError(f"pools.*.remote.address must name one Ray cluster, got {sorted(addresses)}")
