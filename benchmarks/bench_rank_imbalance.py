"""What lockstep costs a node whose data-parallel ranks each decode their own steps (issue 29, item 2).

    python benchmarks/bench_rank_imbalance.py [--samples 4096] [--ranks 2] [--batch 8] [--depths 1,2,4,8,16,64]
                                              [--work DIR] [--out FILE.json]

The plan balances the ranks' *tokens* (the accelerator's work), not their *decode CPU*: a step of
photos stored as PNG, or one with more clips, costs its rank's decode worker more than its tokens
say. In a synchronous job every rank takes step k together (the all-reduce), so a rank whose worker
is ahead fills its read-ahead and then idles while another rank's worker catches up. This measures
how much of the node's decode capacity that leaves unused, on the training scenario's mix:

1. the data: the mix of `omnifeed bench --scenario training` (`_bench_training_data`: photos with
   captions, long-tailed text, H.264 clips, FLAC speech), generated once under ``--work``; the plan
   in budget mode at the budget `--suggest-budget BATCH` prints;
2. each rank's steps: an in-process `FeedClient` per rank takes one epoch (the keys of every step);
3. each sample's decode CPU: every sample decoded once with the scenario's decoder
   (`SampleDecoder`), ``time.thread_time()`` around it;
4. the model (no compute: the data-heavy limit): each rank has one decode worker making its steps
   in order, at most ``depth`` steps ahead of the step the ranks last took together; step k is
   taken when every rank has made it. Per depth: the epoch's wall time and the cores the workers
   keep busy (CPU over wall). One decode pool shared by the node's ranks would keep every core busy
   (``shared_wall_s``: the CPU over the cores).

The model leaves out everything but decoding (reading, collating, the hand-off), so its figures
are the part lockstep alone explains. Prints a table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def rank_steps(data: Any, ranks: int) -> list[list[list[str]]]:
    """Each rank's steps (the keys of each batch) over one epoch, from an in-process `FeedClient` per rank."""
    from omnifeed.loader.service import ServiceConfig
    from omnifeed.tools._bench_training_data import feed_config
    from omnifeed.trainer_adapter import FeedClient

    config = ServiceConfig(index=data.index, feed=feed_config(data.budget["suggested_budget"], 1))
    steps = []
    for rank in range(ranks):
        client = FeedClient.in_process(config, rank=rank, world_size=ranks)
        try:
            steps.append([list(batch["__key__"]) for batch in client])
        finally:
            client.close()
    return steps


def decode_seconds(folder: str) -> dict[str, float]:
    """Each sample's decode CPU seconds (key: the file stem the index knows it by), the scenario's decoder."""
    from omnifeed.tools._bench_spec import SampleDecoder, folder_samples
    from omnifeed.tools._bench_training_data import training_decode

    decoder = SampleDecoder(training_decode())
    seconds = {}
    for key, paths in folder_samples(folder):
        fields = {name: path.read_bytes() for name, path in paths.items()}
        started = time.thread_time()
        decoder(fields, Path(key).name)
        seconds[Path(key).name] = time.thread_time() - started
    return seconds


def lockstep(costs: list[list[float]], depth: int) -> dict[str, float]:
    """One worker per rank, ``depth`` steps ahead at most, a step taken when every rank has made it."""
    steps = min(len(c) for c in costs)
    taken = [0.0] * steps  # when step k was taken by every rank
    free = [0.0] * len(costs)  # when each rank's worker is next free
    for k in range(steps):
        made = []
        for rank, rank_costs in enumerate(costs):
            start = max(free[rank], taken[k - depth] if k >= depth else 0.0)
            free[rank] = start + rank_costs[k]
            made.append(free[rank])
        taken[k] = max(made)
    cpu = sum(sum(c[:steps]) for c in costs)
    wall = taken[-1] if steps else 0.0
    return {"depth": depth, "wall_s": round(wall, 3), "cores_busy": round(cpu / wall, 3) if wall else 0.0}


def measure(work: Path, samples: int, ranks: int, batch: int, depths: list[int]) -> dict[str, Any]:
    """Generate (or reuse) the mix, find each rank's steps and each sample's decode CPU, model every depth."""
    from omnifeed.tools._bench_training_data import TrainingData, write_training_data

    saved = work / f"data-{samples}-{batch}.json"
    if saved.exists():
        data = TrainingData(**json.loads(saved.read_text()))
    else:
        data = write_training_data(work / f"data-{samples}-{batch}", samples, batch)
        saved.write_text(json.dumps(dataclasses.asdict(data)))
    steps = rank_steps(data, ranks)
    seconds = decode_seconds(data.folder)
    costs = [[sum(seconds[key] for key in step) for step in rank] for rank in steps]
    cpu = sum(sum(c[: min(len(r) for r in costs)]) for c in costs)
    return {
        "samples": data.samples,
        "ranks": ranks,
        "batch": batch,
        "budget": data.budget["suggested_budget"],
        "steps": min(len(c) for c in costs),
        "rank_samples": [sum(len(step) for step in rank) for rank in steps],
        "rank_decode_s": [round(sum(c), 3) for c in costs],
        "decode_ms_per_sample": round(1e3 * sum(seconds.values()) / max(len(seconds), 1), 3),
        "shared_wall_s": round(cpu / ranks, 3),
        "depths": [lockstep(costs, depth) for depth in depths],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096, help="samples of the mix (default 4096)")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks of the node (default 2)")
    parser.add_argument("--batch", type=int, default=8, help="the budget is the one for this batch size (default 8)")
    parser.add_argument("--depths", default="1,2,4,8,16,64", help="read-ahead depths to model, steps")
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / "_work" / "rank-imbalance")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results-rank-imbalance.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    depths = [int(d) for d in args.depths.split(",")]
    report = measure(args.work, args.samples, args.ranks, args.batch, depths)
    print(
        f"{report['samples']} samples, {report['ranks']} ranks, {report['steps']} steps; samples per rank "
        f"{report['rank_samples']}, decode CPU per rank {report['rank_decode_s']} s; one shared pool: "
        f"{report['shared_wall_s']} s"
    )
    print("depth  wall s  cores busy")
    for row in report["depths"]:
        print(f"{row['depth']:5}  {row['wall_s']:6.2f}  {row['cores_busy']:10.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
