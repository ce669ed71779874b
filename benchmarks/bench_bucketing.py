"""Padding and data-parallel balance: fixed-size batches vs cost-budgeted buckets vs packing.

    python benchmarks/bench_bucketing.py [--samples 200000] [--world-size 8]

Lengths are generated, long-tailed like real captions and documents:

- ``text``: text-only samples, token counts log-normal (median ~90, a tail into thousands);
- ``multimodal``: the same texts as captions or documents, plus images (sizes 64–2048 px,
  224-short-side resize, 14 px patches), short videos and audio clips.

For each, one epoch of the plan is dealt to ``--world-size`` ranks and measured with the
same report as ``omnifeed plan --stats``: padding fraction per stream (padded slots / all
slots) and balance (max / mean micro-batch cost across the ranks of a step, worst and mean
over steps). The fixed batch size is chosen so that its mean cost per micro-batch matches
the budget, so both spend the same compute per step. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from omnifeed.bucketing import INDEX_COLUMNS, BucketingConfig, CostModel
from omnifeed.loader import Plan, PlanConfig, PlanCursor
from omnifeed.loader.plan._report import PlanReport


def lengths(samples: int, kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Index length columns for ``samples`` generated samples."""
    rng = np.random.default_rng(seed)
    columns = {name: np.zeros(samples) for name in INDEX_COLUMNS}
    columns["text_tokens"] = np.clip(rng.lognormal(4.5, 1.1, samples), 4, 8000).astype(np.int64)
    if kind == "multimodal":
        mix = rng.choice(4, samples, p=[0.4, 0.4, 0.1, 0.1])  # text only, image, video, audio
        captions = np.clip(rng.lognormal(3.0, 0.5, samples), 4, 120).astype(np.int64)
        columns["text_tokens"] = np.where(mix == 0, columns["text_tokens"], captions)
        image = mix == 1
        columns["image_width"] = np.where(image, rng.integers(64, 2048, samples), 0)
        columns["image_height"] = np.where(image, rng.integers(64, 2048, samples), 0)
        video = mix == 2
        columns["video_frames"] = np.where(video, rng.integers(8, 64, samples), 0)
        columns["video_fps"] = np.where(video, 24.0, 0)
        columns["video_width"] = np.where(video, 320, 0)
        columns["video_height"] = np.where(video, 240, 0)
        columns["audio_seconds"] = np.where(mix == 3, np.clip(rng.lognormal(1.5, 0.8, samples), 0.5, 60), 0)
    return columns


def run(columns: dict[str, np.ndarray], config: PlanConfig, world_size: int, cost: CostModel) -> dict:
    """One epoch of ``config`` over the generated lengths, dealt to ``world_size`` ranks."""
    samples = len(columns["text_tokens"])
    start = time.perf_counter()
    plan = Plan(samples, config, index_fingerprint="bench", lengths=lambda p: {k: v[p] for k, v in columns.items()})
    cursor, report = PlanCursor(plan, world_size=world_size), PlanReport(plan, cost=cost)
    while not cursor.epoch_delivered(0):
        report.add(cursor.next_step())
    return {**report.stats(), "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--budget", type=float, default=65536)
    args = parser.parse_args()
    cost = CostModel(video_fps=2.0)
    results = {}
    for kind in ("text", "multimodal"):
        columns = lengths(args.samples, kind)
        budgeted = PlanConfig(seed=0, bucketing=BucketingConfig(budget=args.budget, cost=cost, overlong="alone"))
        bucketed = run(columns, budgeted, args.world_size, cost)
        mean_samples = bucketed["samples"] / bucketed["micro_batches"]
        fixed = run(columns, PlanConfig(seed=0, batch_size=max(1, round(mean_samples))), args.world_size, cost)
        results[kind] = {"fixed": fixed, "bucketed": bucketed}
        if kind == "text":
            packing = BucketingConfig(mode="packing", budget=args.budget / 8, cost=cost, overlong="split")
            results[kind]["packed"] = run(columns, PlanConfig(seed=0, bucketing=packing), args.world_size, cost)
    print(json.dumps({"samples": args.samples, "world_size": args.world_size, "budget": args.budget, **results}, indent=1))


if __name__ == "__main__":
    main()
