"""The training scenario's jobs with the loaders' knobs varied: A/B runs of one change, alternated (issue 29).

    python benchmarks/bench_training_variants.py --variants dataloader:1 omnifeed:1 omnifeed:1:16 omnifeed-service:2
                                                 [--points data-heavy] [--rounds 2] [--samples 1024] [--work DIR]
                                                 [--out FILE.json]

Each variant is ``LOADER:PER_RANK[:PREFETCH_STEPS]``: one of the scenario's loaders (``dataloader``,
``omnifeed``, ``omnifeed-service``), its decode workers per rank (the DataLoader's worker processes, omnifeed's
decode threads; the scenario runs 1) and omnifeed's ``prefetch_steps`` (default: the feed's, 4). The jobs are the
scenario's own (`omnifeed bench --scenario training`: `tools/_bench_training.run_job` on the mix of
`_bench_training_data`, 2 ranks, batch 8, compute calibrated on the DataLoader without compute first); rounds
alternate the order. Prints a line per job (useful utilisation, stall, samples/s, CPU a sample and the cores it
kept busy) and writes every job's figures to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def parse_variant(text: str) -> tuple[str, int, int | None]:
    """``LOADER:PER_RANK[:PREFETCH_STEPS]`` as (loader, per rank, prefetch steps or None)."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: give LOADER:PER_RANK or LOADER:PER_RANK:PREFETCH_STEPS")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None


def run(
    work: Path, samples: int, variants: list[tuple[str, int, int | None]], points: list[str], rounds: int
) -> dict[str, Any]:
    """Every variant at every point, ``rounds`` times alternated: the calibration and every job's figures."""
    import omnifeed.tools._bench_training as training
    from omnifeed.tools._bench_training_data import TrainingData, feed_config, write_training_data

    saved = work / f"data-{samples}.json"
    if saved.exists():
        data = TrainingData(**json.loads(saved.read_text()))
    else:
        data = write_training_data(work / f"data-{samples}", samples, 8)
        saved.write_text(json.dumps(dataclasses.asdict(data)))
    config = training.TrainingConfig(work=work, samples=samples)
    for _ in range(config.warmup_runs):  # as the scenario: a first DataLoader run that counts for nothing
        training.run_job(config, data, "dataloader", 0.0)
    calibration = training.median_run(  # and the median of three DataLoader runs without compute
        [training.job_figures(training.run_job(config, data, "dataloader", 0.0)) for _ in range(3)]
    )
    seconds_per_token = training.calibrate(calibration)
    jobs = []
    order = [(variant, point) for point in points for variant in variants]
    for round_ in range(rounds):
        for (loader, per_rank, prefetch), point in order if round_ % 2 == 0 else order[::-1]:
            update = {} if prefetch is None else {"prefetch_steps": prefetch}
            # run_job gives the scenario's `feed_config` workers // ranks threads (here per_rank); prefetch on top
            training.feed_config = lambda budget, threads, u=update: feed_config(budget, threads).model_copy(update=u)
            job = dataclasses.replace(config, workers=per_rank * config.ranks)
            figures = training.job_figures(training.run_job(job, data, loader, seconds_per_token[point]))
            figures.update(loader=loader, per_rank=per_rank, prefetch_steps=prefetch, point=point, round=round_)
            jobs.append(figures)
            cores = figures["samples_per_s"] * figures["cpu_ms_per_sample"] / 1e3
            print(
                f"round {round_ + 1} {point:13} {loader}:{per_rank}:{prefetch or '-'}"
                f"  useful {figures['useful_util']:.3f}"
                f"  stall {figures['stall']:.3f}  {figures['samples_per_s']:.0f} samples/s"
                f"  {figures['cpu_ms_per_sample']:.2f} ms CPU a sample  {cores:.2f} cores",
                flush=True,
            )
    return {"samples": data.samples, "calibration": calibration, "seconds_per_token": seconds_per_token, "jobs": jobs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", type=parse_variant, required=True, help="LOADER:PER_RANK[:PREFETCH]")
    parser.add_argument(
        "--points", nargs="+", default=["data-heavy"], choices=["no-compute", "data-heavy", "compute-heavy"]
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1024, help="samples of the mix (the scenario's: 1024)")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "_work" / "training-variants")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "_work" / "training-variants.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    report = run(args.work, args.samples, args.variants, args.points, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
