"""`FeedConfig`: everything the feed engine needs besides the index, as validated data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...cache import CacheConfig
from .._config import load_yaml, validated
from .._config_paths import FEED_PATHS, resolve_paths
from ..decode import DecodeConfig
from ..plan import PlanConfig
from ._remote_config import RemoteConfig, check_remote_pools
from ._transform_config import TransformsConfig


class PoolConfig(BaseModel):
    """One modality's decode workers and its bounded ready buffer; ``executor`` says where its fields decode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    executor: Literal["threads", "processes", "ray"] = Field(
        default="threads",
        description="Where this modality's fields decode: threads (the pool's own, ``workers`` of them), processes "
        "(``workers`` decode processes, for decoders that hold the GIL; twice as many pool threads hand tasks over) "
        "or ray (the actors of ``remote``, default ``{workers: 2}``, beside ``workers`` local threads, which hand "
        "tasks to ``processes`` if set; 0: on Ray only). Unset: ray with ``remote``, processes with ``processes``, "
        "else threads.",
    )
    workers: int = Field(
        default=1, ge=0, description="Decode workers of the executor: threads, processes, or local threads beside Ray."
    )
    processes: int = Field(
        default=0,
        ge=0,
        description="Decode processes, with ``workers`` then the pool threads that hand tasks to them (processes: "
        "0 means as many as ``workers``; ray: the local side's).",
    )
    shared_memory: bool = Field(
        default=True,
        description="With processes: each process writes decoded arrays into a shared-memory area of its own "
        "(buffer_bytes / processes, plus 16 MiB; pages are used only as filled) and the pipe carries their headers; "
        "false: arrays are pickled through the pipe.",
    )
    buffer_samples: int = Field(default=256, ge=1, description="Samples of this modality decoded ahead, at most.")
    buffer_bytes: int = Field(default=512 * 2**20, ge=1, description="Bytes of decoded output held ahead, at most.")
    remote: RemoteConfig | None = Field(
        default=None, description="The Ray actors of executor ray (docs/service.md); none for the other executors."
    )

    @model_validator(mode="before")
    @classmethod
    def _executor_from_fields(cls, data: Any) -> Any:
        """Unset, the executor follows the fields (``remote``: ray, ``processes``: processes); ray gets its actors."""
        if not isinstance(data, dict):
            return data
        executor = data.get("executor")
        if executor is None:
            executor = "ray" if data.get("remote") is not None else "processes" if data.get("processes") else "threads"
            data = {**data, "executor": executor}
        if executor == "ray" and data.get("remote") is None:
            data = {**data, "remote": {}}
        return data

    @model_validator(mode="after")
    def _fields_fit_the_executor(self) -> PoolConfig:
        if self.processes and self.executor == "threads":
            raise ValueError(f"processes: {self.processes} decodes in processes: set executor: processes")
        if self.remote is not None and self.executor != "ray":
            raise ValueError(f"remote decodes on Ray: set executor: ray (not {self.executor})")
        if self.executor == "processes" and not self.decode_processes:
            raise ValueError("executor processes needs workers: 1 or more")
        return self

    @property
    def decode_processes(self) -> int:
        """Decode processes this modality runs (0: it decodes in threads)."""
        return (self.processes or self.workers) if self.executor == "processes" else self.processes

    @property
    def threads(self) -> int:
        """The pool's own threads for this modality: its decoders, or with processes the ones handing tasks over."""
        return 2 * self.workers if self.executor == "processes" and not self.processes else self.workers


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
    transforms: TransformsConfig = Field(
        default_factory=TransformsConfig,
        description="Per-modality augmentation after decoding, random by (plan seed, epoch, sample key).",
    )
    pools: dict[str, PoolConfig] = Field(default_factory=_default_pools, description="Per-modality pools.")
    shared_workers: Annotated[int, Field(ge=0)] | Literal["cpus"] = Field(
        default=1,
        description="Threads that serve every modality, each taking the task its consumer needs soonest; `cpus`: one "
        "a CPU this process may run on, following its affinity as it changes (threads beyond it wait, more start "
        "when it grows), as a service's producer processes on their CPU windows decode.",
    )
    prefetch_steps: int = Field(default=4, ge=1, description="Steps of this rank planned and queued ahead.")
    numpy_hugepages: bool = Field(
        default=False,
        description="numpy's transparent huge pages for arrays of 4 MiB or more in a process whose feed decodes in "
        "threads (numpy's default is on; off, a fresh decoded clip or padded batch is not zeroed 2 MiB at a time on "
        "first touch). Process-wide; NUMPY_MADVISE_HUGEPAGE in the environment wins.",
    )
    cache: CacheConfig = Field(
        default_factory=CacheConfig,
        description="Cache tiers (RAM, NVMe) and origin reads (timeouts, retries, latency monitor, I/O threads).",
    )
    error_budget: float = Field(
        default=0.01, ge=0, le=1, description="Fraction of samples that may fail before the feed stops with an error."
    )
    error_budget_min_samples: int = Field(
        default=200, ge=1, description="Samples read before the error budget is enforced."
    )

    @model_validator(mode="after")
    def _remote_pools_agree(self) -> FeedConfig:
        check_remote_pools(self.pools)
        return self

    @model_validator(mode="after")
    def _budgets_match_decoding(self) -> FeedConfig:
        """With bucketing, the cost model must charge for the sizes the decoders will produce."""
        bucketing = self.plan.bucketing
        if bucketing is None:
            return self
        cost, image = bucketing.cost, self.decode.image
        expected = ("fixed", image.size) if image.crop == "center" else (image.resize, image.size)
        charged = (cost.image_resize, cost.image_size)
        cropped = self.transforms.final_image_size()
        if cropped is not None:  # a built-in crop decides the size the batch holds
            if cropped[0] != cropped[1] or charged != ("fixed", cropped[0]):
                raise ValueError(
                    f"transforms.image crops to {cropped[0]}x{cropped[1]} but the plan's cost model charges images as "
                    f"{charged[0]} {charged[1]}: with bucketing, crop to a square and set "
                    f"plan.bucketing.cost.image_resize: fixed, image_size: {cropped[0]}"
                )
        elif expected != charged or (
            image.resize == "short_side" and image.crop == "none" and cost.max_image_size != image.max_size
        ):
            raise ValueError(
                f"the plan's cost model charges images as {charged[0]} {charged[1]} (max {cost.max_image_size}) but "
                f"decode.image produces {expected[0]} {expected[1]} (max {image.max_size}): set "
                "plan.bucketing.cost.image_resize/image_size/max_image_size to match (crop 'center' is 'fixed')"
            )
        frames = self.decode.video.num_frames
        if frames is not None and cost.video_max_frames != frames:
            raise ValueError(
                f"decode.video.num_frames is {frames} but plan.bucketing.cost.video_max_frames is "
                f"{cost.video_max_frames}: set them equal so video budgets count the frames decoded"
            )
        return self

    def pool(self, modality: str) -> PoolConfig:
        """The pool configuration of ``modality`` (a default one when not configured)."""
        return self.pools.get(modality) or _default_pools().get(modality, PoolConfig())

    @classmethod
    def from_yaml(cls, path: str | Path) -> FeedConfig:
        """Load a feed config from YAML: top-level ``plan``, ``decode``, ``pools``, ... (see docs/config.md)."""
        data: dict[str, Any] = load_yaml(path)
        data.pop("index", None)  # the same file may configure `omnifeed index`
        return validated(cls, resolve_paths(data, Path(path), FEED_PATHS), source=path)
