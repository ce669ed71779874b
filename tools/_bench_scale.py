"""The scale scenario of `omnifeed bench`: the planning side of a large job, simulated on one machine.

No data is read for planning: each cell builds a `Plan` of ``samples`` positions whose lengths
come from a hash of the position (`synthetic_lengths`), at one data-parallel world size × gradient
accumulation × batching (fixed batches, or a cost budget with ``overlong: alone``), and measures
with ``time.process_time`` (CPU of this process):

- the first step (``next_step()`` + ``for_rank(r)`` for each of a node's ``local_ranks`` ranks: a node
  deals each step once for all its streams, `DealtSteps`; it plans the first window), then the mean of
  later steps, taken over at least ``steps`` steps and until the cursor has crossed a window
  boundary (a budget window is planned once per many steps: a mean inside one window would hide it);
- the state's size (``json.dumps(cursor.state_dict())``), a resume (a new plan, the state loaded,
  one step) and a resize (the state loaded into a cursor of world size dp/2, one step).

``budget-written`` cells are the budget's with its epoch planned once and written ahead
(`write_planned_epochs`, what ``omnifeed plan --write-epochs`` does) over ``written_samples`` positions: the
cursor then deals a step by look-up. Writing the epoch is a job of its own, before training
(``write_s``, CPU, reported with each such cell); a step's, a resume's and a resize's cost do not depend on the
epoch's size, so a smaller one than ``samples`` measures the same thing.

The dealing CPU per local rank is the node's CPU for a step over its ``local_ranks`` ranks. Fixed-size batches
are dealt in closed form (a step computes only the micro-batches the node's ranks take); a cost budget's step
plans every window the step spans, so its cost follows the world's micro-batches per step.
Each measurement is bounded: a step still dealing after ``cell_seconds`` of CPU is stopped
(`DealingStopped`) and the figure recorded as cut (a lower bound).

The index side (`_bench_scale_index`): a synthetic index of each of ``index_rows`` sizes opened by
`SampleIndex` in a fresh interpreter: open time, one position's lookup, resident memory added, a plan
built from it and resumed (fixed batches and a budget); with a projection to 10⁹ rows, stated as one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnifeed.bucketing import BucketingConfig
from omnifeed.loader.plan import DealingStopped, Plan, PlanConfig, PlanCursor, PlannedEpochs, write_planned_epochs

BATCHINGS = ("fixed", "budget", "budget-written")
MAX_STEPS = 100_000  # a cell never deals more steps than this while waiting for a window boundary


@dataclass(frozen=True)
class ScaleConfig:
    """What the scale scenario measures."""

    work: Path
    samples: tuple[int, ...] = (1_000_000_000,)
    world_sizes: tuple[int, ...] = (64, 1024, 4096)
    accums: tuple[int, ...] = (1, 16)
    steps: int = 3  # later steps measured at least (and until a window boundary is crossed)
    cell_seconds: float = 40.0  # CPU limit of each measurement of a cell (the steps, the resume, the resize)
    local_ranks: int = 8  # streams of a node (the assumption behind per-node figures)
    batch_size: int = 8
    budget: float = 16384.0
    written_samples: int = 20_000_000  # positions of the budget-written cells' epoch (0: no such cells)
    index_rows: tuple[int, ...] = (1_000_000,)  # sizes of the index measured; (): none
    index_cache: Path | None = None  # where the synthetic indexes are kept across runs (None: under work, each run)
    python: str = sys.executable


def synthetic_lengths(positions: np.ndarray) -> dict[str, np.ndarray]:
    """Length columns from a hash of each position: captions with photos (2 of 3) and long-tailed documents."""
    positions = np.asarray(positions)
    x = positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(29)
    u = (x % np.uint64(1_000_003)).astype(np.float64) / 1_000_003
    photo = (positions % 3) != 0
    zeros = np.zeros(len(positions))
    return {
        "text_tokens": np.where(photo, 8 + (u * 40).astype(np.int64), (np.exp(4 + 3 * u)).astype(np.int64)),
        "image_width": np.where(photo, 200 + (u * 1800).astype(np.int64), 0),
        "image_height": np.where(photo, 200 + ((1 - u) * 1200).astype(np.int64), 0),
        **{n: zeros for n in ("video_frames", "video_fps", "video_width", "video_height", "audio_seconds")},
    }


def plan_config(batching: str, config: ScaleConfig) -> PlanConfig:
    """Fixed batches of ``batch_size``, or a cost budget with overlong samples alone."""
    if batching == "fixed":
        return PlanConfig(seed=1, batch_size=config.batch_size)
    return PlanConfig(seed=1, bucketing=BucketingConfig(budget=config.budget, overlong="alone"))


def _deal(cursor: PlanCursor, limit_s: float, local_ranks: int = 1) -> tuple[float, bool]:
    """CPU seconds of one step dealt for a node (``next_step`` + the shares of its first ``local_ranks`` ranks), and
    whether it finished within ``limit_s``."""
    start = time.process_time()
    deadline = start + limit_s
    try:
        step = cursor.next_step(stop=lambda: time.process_time() > deadline)
        for rank in range(min(local_ranks, cursor.world_size)):
            step.for_rank(rank)
    except DealingStopped:
        return time.process_time() - start, False
    return time.process_time() - start, True


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _written(samples: int, config: ScaleConfig) -> tuple[Path, float]:
    """The folder holding the budget's epoch 0 over ``samples`` written ahead (written now if missing), and the CPU
    seconds writing it took (0: written by an earlier cell)."""
    folder = config.work / f"written-{samples}"
    plan = Plan(
        samples, plan_config("budget", config), index_fingerprint="scale", lengths=synthetic_lengths, index_path=folder
    )
    written = PlannedEpochs.find(folder, plan)
    if written is not None and written.epoch(0) is not None:
        return folder, 0.0
    started = time.process_time()
    write_planned_epochs(plan, folder, range(1))
    return folder, time.process_time() - started


def measure_cell(samples: int, dp: int, accum: int, batching: str, config: ScaleConfig) -> dict[str, Any]:
    """One cell's figures (seconds are CPU seconds of this process; ``cut`` names the measurements stopped)."""
    folder, write_s = _written(samples, config) if batching == "budget-written" else (None, 0.0)

    def make() -> Plan:
        return Plan(
            samples,
            plan_config(batching, config),
            index_fingerprint="scale",
            lengths=synthetic_lengths,
            index_path=folder,
        )

    limit = config.cell_seconds
    started = time.process_time()
    plan = make()
    row: dict[str, Any] = {
        "samples": samples,
        "dp": dp,
        "accum": accum,
        "batching": batching,
        "micro_batches_per_step": dp * accum,
        "window_samples": plan.window_size,
        "plan_build_s": round(time.process_time() - started, 4),
        "cut": [],
        **({"write_s": round(write_s, 2)} if batching == "budget-written" else {}),
    }
    cursor = PlanCursor(plan, world_size=dp, grad_accum=accum)
    local = min(config.local_ranks, dp)
    first, done = _deal(cursor, limit, local)
    row["first_step_s"] = round(first, 4)
    if not done:  # the stopped first step is the lower bound of every figure; resume and resize would be too
        row["cut"] += ["first_step", "steps", "resume", "resize"]
        return {
            **row,
            "steps": 0,
            "crossed_window": False,
            "step_s": round(first, 6),
            "per_local_rank_ms": round(first * 1e3 / local, 3),
            "node_cpu_s_per_step": round(first, 4),
            "state_bytes": None,
            "resume_s": None,
            "resize_to_dp": max(1, dp // 2),
            "resize_s": None,
            "rss_mb": round(_rss_mb(), 1),
        }
    mark = (cursor.epoch, cursor.window)
    spent, steps, deadline = 0.0, 0, time.process_time() + limit
    while steps < MAX_STEPS and (steps < config.steps or (cursor.epoch, cursor.window) == mark):
        seconds, done = _deal(cursor, max(0.0, deadline - time.process_time()), local)
        if not done:
            row["cut"].append("steps")
            if steps == 0:  # not one later step finished: the stopped one is a lower bound
                spent, steps = seconds, 1
            break
        spent, steps = spent + seconds, steps + 1
    step_s = spent / steps
    row.update(
        steps=steps,
        crossed_window=(cursor.epoch, cursor.window) != mark,
        step_s=round(step_s, 6),
        per_local_rank_ms=round(step_s * 1e3 / local, 3),
        node_cpu_s_per_step=round(step_s, 4),
    )
    state = json.dumps(cursor.state_dict())
    row["state_bytes"] = len(state)
    row.update(_resume(make, state, dp, accum, limit, row["cut"]))
    row.update(_resize(make, state, max(1, dp // 2), accum, limit, row["cut"]))
    row["rss_mb"] = round(_rss_mb(), 1)
    return row


def _resume(make: Callable[[], Plan], state: str, dp: int, accum: int, limit: float, cut: list[str]) -> dict[str, Any]:
    """A restarted job: a new plan, the state loaded, one step (CPU and wall seconds)."""
    cpu, wall = time.process_time(), time.perf_counter()
    cursor = PlanCursor(make(), world_size=dp, grad_accum=accum)
    cursor.load_state_dict(json.loads(state))
    _, done = _deal(cursor, limit)
    if not done:
        cut.append("resume")
    return {"resume_s": round(time.process_time() - cpu, 4), "resume_wall_s": round(time.perf_counter() - wall, 4)}


def _resize(make: Callable[[], Plan], state: str, dp: int, accum: int, limit: float, cut: list[str]) -> dict[str, Any]:
    """A running job shrunk to ``dp`` ranks: the state loaded into a cursor of that world size, one step."""
    plan = make()  # built before the clock: the running job has its plan
    cpu = time.process_time()
    cursor = PlanCursor(plan, world_size=dp, grad_accum=accum)
    cursor.load_state_dict(json.loads(state))
    _, done = _deal(cursor, limit)
    if not done:
        cut.append("resize")
    return {"resize_to_dp": dp, "resize_s": round(time.process_time() - cpu, 4)}


def measure_index(config: ScaleConfig) -> dict[str, Any]:
    """The index at each of ``index_rows`` (`_bench_scale_index`): the largest's figures, every size's, and the
    projection to 10⁹ rows."""
    from ._bench_scale_index import measure_index_size, projection

    where = config.index_cache or config.work / "index"
    sizes = [measure_index_size(where, rows, config.python) for rows in sorted(config.index_rows)]
    return {**sizes[-1], "sizes": sizes, "projection": projection(sizes)}


def run_scale(config: ScaleConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every cell (samples × dp × accum × batching), then the index: the report."""
    config.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cells = []
    runs = [(samples, batching) for samples in config.samples for batching in ("fixed", "budget")]
    if config.written_samples:
        runs.append((config.written_samples, "budget-written"))
    for samples, batching in runs:
        for accum in config.accums:
            for dp in config.world_sizes:
                cell = measure_cell(samples, dp, accum, batching, config)
                cells.append(cell)
                if log is not None:
                    log(
                        f"{samples:,} samples {batching:14} dp {dp:5} × accum {accum:2}: first step "
                        f"{cell['first_step_s']:.3f} s, step {cell.get('per_local_rank_ms') or 0:.2f} ms, "
                        f"resume {cell['resume_s'] or float('nan'):.3f} s, "
                        f"resize {cell['resize_s'] or float('nan'):.3f} s"
                        + (f" (cut: {', '.join(cell['cut'])})" if cell["cut"] else "")
                        + (f"; epoch written ahead in {cell['write_s']:.1f} s" if cell.get("write_s") else "")
                    )
    index = measure_index(config) if config.index_rows else None
    if log is not None and index is not None:
        log(f"index of {index['rows']:,} rows: {json.dumps(index)}")
    try:
        load = list(os.getloadavg())
    except OSError:  # pragma: no cover
        load = []
    return {
        "machine": {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in load]},
        "settings": {
            **{
                k: list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v
                for k, v in asdict(config).items()
                if k not in ("work", "python")
            },
            "elapsed_s": round(time.perf_counter() - started, 1),
            "assumption": f"{config.local_ranks} local ranks a node; a node deals each step once for all its "
            "ranks (DealtSteps), so the dealing CPU per local rank is the node's CPU for a step over local_ranks",
        },
        "targets": {"per_local_rank_ms": 1.0, "resume_s": 1.0, "state_bytes": 1024, "resize_s": 1.0},
        "cells": cells,
        "index": index,
    }


def scale_command(config: ScaleConfig) -> int:
    """`omnifeed bench --scenario scale`: the table on stdout, report.json and scale.png under ``config.work``."""
    from ._bench_report import scenario_command
    from ._bench_scale_report import render_scale, write_scale_plot

    return scenario_command(
        config.work, lambda log: run_scale(config, log), render_scale, write_scale_plot, "scale.png"
    )
