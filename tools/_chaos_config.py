"""What `omnifeed chaos` runs (`ChaosConfig`: the long version's defaults, `ChaosConfig.quick` the test suite's)
and what happened during a run (`Tally`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChaosConfig:
    """What the soak runs and how hard it hits; the defaults are the long version's."""

    minutes: float
    out: Path
    seed: int = 0
    samples: int = 240
    shards: int = 6
    batch_size: int = 4
    world_sizes: tuple[int, ...] = (1, 2, 3)
    save_every: int = 2  # steps between checkpoints
    fail_fraction: float = 0.03  # share of storage requests answered 503
    latency_s: float = 0.004  # base storage latency per request, seconds
    spike_factor: float = 10.0
    spike_s: tuple[float, float] = (2.0, 5.0)  # a spike lasts this long, seconds
    interval_s: tuple[float, float] = (4.0, 10.0)  # between faults, seconds

    @classmethod
    def quick(cls, out: Path, seed: int = 0, minutes: float = 0.4) -> ChaosConfig:
        """The short version for the test suite: a small dataset, 1 or 2 ranks, faults every 1-2.5 s."""
        return cls(
            minutes=minutes,
            out=out,
            seed=seed,
            samples=48,
            shards=3,
            world_sizes=(1, 2),
            interval_s=(1.0, 2.5),
            spike_s=(1.0, 2.5),
        )


@dataclass
class Tally:
    """What happened during the run."""

    injected: dict[str, int] = field(default_factory=dict)
    resizes: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    jobs: int = 0
    epochs: int = 0
    storage: dict[str, int] = field(default_factory=dict)


def config_json(config: ChaosConfig) -> dict[str, Any]:
    """The config as JSON values (paths as strings), for the summary."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
