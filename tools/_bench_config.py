"""What `omnifeed bench` runs (`BenchConfig`) and what one loader on one pipeline measured (`Row`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._bench_names import LOADERS
from ._bench_spec import PIPELINES


@dataclass(frozen=True)
class BenchConfig:
    """What `omnifeed bench` runs."""

    work: Path
    images: int = 2048
    mixed: int = 1536
    workers: int = 2
    batch_size: int = 64
    rounds: int = 1
    loaders: Sequence[str] = LOADERS
    pipelines: Sequence[str] = PIPELINES
    data: Path | None = None  # a folder of JPEG files or of WebDataset shards to use instead of generated images
    python: str = sys.executable
    timeout_s: float = 1800.0
    limit_seconds: float = 3.0  # how long the decode limit is measured per pipeline
    node_ranks: int = 2  # trainer ranks of the node scenario (`_bench_node`; 0: not run)


@dataclass
class Row:
    """One loader on one pipeline: the median over rounds, or why it did not run."""

    loader: str
    pipeline: str
    status: str = "ok"
    samples: int = 0
    samples_per_s: float = 0.0
    cpu_s_per_sample: float = 0.0
    first_batch_s: float = 0.0
    peak_pss_mib: float = 0.0
    vs_dataloader: float | None = None
    vs_decode_limit: float | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)
