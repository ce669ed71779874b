"""Padding and data-parallel balance: fixed-size batches vs cost-budgeted buckets vs packing.

    python benchmarks/bench_bucketing.py [--samples 200000] [--world-size 8] [--mix-budgets 16384 32768 65536]
        [--sections text multimodal unseen resume]

Lengths are generated, long-tailed:

- ``text``: text-only samples, token counts log-normal (median ~90, a tail into thousands):
  fixed-size batches vs a budget vs packing, at ``--budget`` and ``--world-size``;
- ``multimodal``: a mix of the four modalities (``mix_lengths``: documents, photos with
  captions, clips with captions and some with speech, speech with transcripts) under a
  realistic cost model (clips at 2 fps capped at 16 frames, short side 224, 14 px patches),
  at each of ``--mix-budgets`` and ``--mix-world-sizes``, dealt in cost tiers (the default)
  and, for comparison, shuffled across the window (``tier_width: null``); plus packing of
  the text stream;
- ``unseen``: a long-tailed four-modality mix the plan was never tuned on, with a rare modality
  (``unseen_mix_lengths``: speech 4 % of samples), at ``--unseen-budgets`` and
  ``--mix-world-sizes``, cost tiers, ``overlong: alone`` (issue 29);
- ``resume``: seconds to build a plan of the unseen mix, deal its first step, and resume it
  mid-epoch at another world size, at ``--samples`` and ten times as many.

Each is one epoch of the plan dealt to the ranks and measured with the same report as
``omnifeed plan --stats``: padding fraction per stream (padded slots / all slots) and balance
(max / mean micro-batch cost across the ranks of a step, worst and mean over steps). The
fixed batch size matches the budgeted run's samples per micro-batch. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from omnifeed.bucketing import INDEX_COLUMNS, BucketingConfig, CostModel
from omnifeed.loader import Plan, PlanConfig, PlanCursor
from omnifeed.loader.plan import PlanReport


def lengths(samples: int, kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Index length columns for ``samples`` generated samples."""
    if kind == "mix":
        return mix_lengths(samples, seed)
    rng = np.random.default_rng(seed)
    columns = {name: np.zeros(samples) for name in INDEX_COLUMNS}
    columns["text_tokens"] = np.clip(rng.lognormal(4.5, 1.1, samples), 4, 8000).astype(np.int64)
    return columns


def mix_lengths(samples: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A long-tailed multimodal corpus: documents; photos + captions; clips + captions (some with speech); speech +
    transcripts.

    35 % text documents (tokens log-normal, median ~400, tail to 8,192); 35 % photos (side
    log-normal around 700 px, aspect ratios log-normal) with captions (median ~25 tokens, tail
    to 256); 10 % clips (seconds log-normal, median ~9 s, tail to 10 min; 24/30/60 fps;
    360p to 1080p, some portrait) with captions, 5 % with speech too (audio = the clip's
    first 30 s); 15 % speech (seconds log-normal, median ~6 s, up to 30 s) with transcripts
    (~3 tokens per second).
    """
    rng = np.random.default_rng(seed)
    columns = {name: np.zeros(samples) for name in INDEX_COLUMNS}
    kind = rng.choice(5, samples, p=[0.35, 0.35, 0.10, 0.05, 0.15])  # doc, photo, clip, clip + speech, speech
    docs = np.clip(rng.lognormal(6.0, 1.0, samples), 16, 8192)
    captions = np.clip(rng.lognormal(3.2, 0.6, samples), 3, 256)
    side = np.clip(rng.lognormal(6.6, 0.5, samples), 64, 4096)
    aspect = np.exp(rng.normal(0, 0.35, samples))
    photo, clip = kind == 1, (kind == 2) | (kind == 3)
    columns["image_width"] = np.where(photo, np.round(side * aspect), 0)
    columns["image_height"] = np.where(photo, np.round(side / aspect), 0)
    seconds = np.clip(rng.lognormal(2.2, 0.9, samples), 1, 600)
    fps = rng.choice([24.0, 30.0, 60.0], samples)
    resolution = rng.choice(4, samples, p=[0.3, 0.4, 0.2, 0.1])
    columns["video_frames"] = np.where(clip, np.round(seconds * fps), 0)
    columns["video_fps"] = np.where(clip, fps, 0)
    columns["video_width"] = np.where(clip, np.array([640, 1280, 1920, 1080])[resolution], 0)
    columns["video_height"] = np.where(clip, np.array([360, 720, 1080, 1920])[resolution], 0)
    speech = np.clip(rng.lognormal(1.8, 0.7, samples), 0.5, 30)
    transcripts = np.clip(speech * rng.normal(3.0, 0.6, samples), 2, 512)
    columns["audio_seconds"] = np.where(kind == 4, speech, np.where(kind == 3, np.minimum(seconds, 30), 0))
    columns["text_tokens"] = np.where(kind == 0, docs, np.where(kind == 4, transcripts, captions)).astype(np.int64)
    return columns


def unseen_mix_lengths(samples: int, seed: int = 1) -> dict[str, np.ndarray]:
    """A long-tailed four-modality corpus unlike `mix_lengths`, with a rare modality: speech is 4 % of samples.

    52 % documents (tokens log-normal, median ~600, σ 1.4, truncated at 32,768: over a 16,384 budget
    alone now and then); 30 % photos (short side log-normal around 600 px, σ 0.5; aspect ratios
    log-normal, σ 0.35; 80 % landscape) with captions (median ~15 tokens, σ 0.5); 14 % clips (4 s to
    2 min, 24/30 fps, 720p/1080p, 80 % landscape) with captions; 4 % short utterances (median ~4 s,
    σ 0.7, 0.5–60 s) with transcripts (~2.7 tokens per second, ± 15 %).
    """
    rng = np.random.default_rng(seed)
    columns = {name: np.zeros(samples) for name in INDEX_COLUMNS}
    kind = rng.choice(4, samples, p=[0.52, 0.30, 0.14, 0.04])  # document, photo, clip, speech
    docs = np.minimum(rng.lognormal(np.log(600), 1.4, samples), 32768)
    captions = np.clip(rng.lognormal(np.log(15), 0.5, samples), 2, 200)
    short = np.clip(rng.lognormal(np.log(600), 0.5, samples), 64, 4000)
    aspect = np.exp(np.abs(rng.normal(0, 0.35, samples)))
    landscape = rng.random(samples) < 0.8
    photo, clip, speech = kind == 1, kind == 2, kind == 3
    columns["image_width"] = np.where(photo, np.round(np.where(landscape, short * aspect, short)), 0)
    columns["image_height"] = np.where(photo, np.round(np.where(landscape, short, short * aspect)), 0)
    seconds = np.clip(rng.lognormal(np.log(20), 0.8, samples), 4, 120)
    fps = rng.choice([24.0, 30.0], samples)
    wide, high = np.where(rng.random(samples) < 0.6, 1280, 1920), landscape
    columns["video_frames"] = np.where(clip, np.round(seconds * fps), 0)
    columns["video_fps"] = np.where(clip, fps, 0)
    columns["video_width"] = np.where(clip, np.where(high, wide, wide * 9 // 16), 0)
    columns["video_height"] = np.where(clip, np.where(high, wide * 9 // 16, wide), 0)
    talk = np.clip(rng.lognormal(np.log(4), 0.7, samples), 0.5, 60)
    columns["audio_seconds"] = np.where(speech, talk, 0)
    transcripts = np.maximum(talk * 2.7 * np.exp(rng.normal(0, 0.15, samples)), 1)
    columns["text_tokens"] = np.where(kind == 0, docs, np.where(speech, transcripts, captions)).astype(np.int64)
    return columns


def run(columns: dict[str, np.ndarray], config: PlanConfig, world_size: int, cost: CostModel) -> dict:
    """One epoch of ``config`` over the generated lengths, dealt to ``world_size`` ranks."""
    samples = len(columns["text_tokens"])
    start = time.perf_counter()
    plan = Plan(samples, config, index_fingerprint="bench", lengths=lambda p: {k: v[p] for k, v in columns.items()})
    cursor, report, last_step = (
        PlanCursor(plan, world_size=world_size),
        PlanReport(plan, cost=cost),
        PlanReport(plan, cost=cost),
    )
    step = cursor.next_step()
    while not cursor.epoch_delivered(0):  # the report trails by one step: the last is measured on its own too
        report.add(step)
        step = cursor.next_step()
    # the epoch's final step deals the last window's light leftovers (nothing carries out of an epoch)
    worst_before_last = report.stats()["balance_max_over_mean"]["worst"]
    report.add(step)
    last_step.add(step)
    stats = report.stats()
    stats["balance_last_step"] = round(last_step.stats()["balance_max_over_mean"]["worst"], 4)
    stats.pop("worst_step", None)
    stats["balance_worst_before_last_step"] = round(worst_before_last, 4)
    stats["window_size"] = plan.window_size
    stats["samples_per_micro_batch"] = round(stats["samples"] / max(stats["micro_batches"], 1), 2)
    return {**stats, "seconds": round(time.perf_counter() - start, 2)}


def text_only(args: argparse.Namespace, cost: CostModel) -> dict:
    """Text only: fixed-size batches vs budget vs packing, at ``--budget`` and ``--world-size``."""
    columns = lengths(args.samples, "text")
    budgeted = PlanConfig(seed=0, bucketing=BucketingConfig(budget=args.budget, cost=cost, overlong="alone"))
    bucketed = run(columns, budgeted, args.world_size, cost)
    fixed = run(
        columns,
        PlanConfig(seed=0, batch_size=max(1, round(bucketed["samples_per_micro_batch"]))),
        args.world_size,
        cost,
    )
    packing = BucketingConfig(mode="packing", budget=args.budget / 8, cost=cost, overlong="split")
    return {
        "fixed": fixed,
        "bucketed": bucketed,
        "packed": run(columns, PlanConfig(seed=0, bucketing=packing), args.world_size, cost),
    }


def multimodal(args: argparse.Namespace) -> dict:
    """The four-modality mix at each budget and world size: cost tiers (the default) vs a shuffled window."""
    cost = CostModel(video_fps=2.0, video_max_frames=16)  # clips capped at 16 frames, short side 224, 14 px patches
    columns = mix_lengths(args.samples)
    out: dict = {"cost": cost.model_dump(), "runs": []}
    for budget in args.mix_budgets:
        for world_size in args.mix_world_sizes:
            for dealing, tier_width in (("tiers", 0.02), ("shuffled", None)):
                bucketing = BucketingConfig(budget=budget, cost=cost, overlong="alone", tier_width=tier_width)
                figures = run(columns, PlanConfig(seed=0, bucketing=bucketing), world_size, cost)
                out["runs"].append({"budget": budget, "world_size": world_size, "dealing": dealing, **figures})
        packing = BucketingConfig(mode="packing", budget=budget / 2, cost=cost, overlong="split")
        out["runs"].append(
            {
                "budget": budget / 2,
                "world_size": args.mix_world_sizes[0],
                "dealing": "packing (text)",
                **run(columns, PlanConfig(seed=0, bucketing=packing), args.mix_world_sizes[0], cost),
            }
        )
    return out


def unseen(args: argparse.Namespace) -> dict:
    """The unseen four-modality mix (speech 4 %) at each of ``--unseen-budgets`` and ``--mix-world-sizes``."""
    cost = CostModel(video_fps=2.0, video_max_frames=16)
    columns = unseen_mix_lengths(args.samples)
    out: dict = {"cost": cost.model_dump(), "runs": []}
    for budget in args.unseen_budgets:
        for world_size in args.mix_world_sizes:
            bucketing = BucketingConfig(budget=budget, cost=cost, overlong="alone")
            figures = run(columns, PlanConfig(seed=0, bucketing=bucketing), world_size, cost)
            out["runs"].append({"budget": budget, "world_size": world_size, **figures})
    return out


def resume_cost(args: argparse.Namespace) -> dict:
    """Seconds to build the plan, deal the first step, and resume mid-epoch at another world size (a new plan, the
    saved state, one step), on the unseen mix at its first budget, for ``--samples`` and ten times as many."""
    cost = CostModel(video_fps=2.0, video_max_frames=16)
    config = PlanConfig(seed=0, bucketing=BucketingConfig(budget=args.unseen_budgets[0], cost=cost, overlong="alone"))
    out = []
    for samples in (args.samples, 10 * args.samples):
        columns = unseen_mix_lengths(samples)

        def lengths(positions: np.ndarray) -> dict[str, np.ndarray]:
            return {k: v[positions] for k, v in columns.items()}

        start = time.perf_counter()
        plan = Plan(samples, config, index_fingerprint="bench", lengths=lengths)
        built = time.perf_counter()
        cursor = PlanCursor(plan, world_size=4)
        cursor.next_step()
        first = time.perf_counter()
        for _ in range(1000):
            cursor.next_step()
        state = cursor.state_dict()
        again = time.perf_counter()
        resumed = PlanCursor(Plan(samples, config, index_fingerprint="bench", lengths=lengths), world_size=3)
        resumed.load_state_dict(state)
        resumed.next_step()
        out.append(
            {
                "samples": samples,
                "window_size": plan.window_size,
                "plan_built_s": round(built - start, 2),
                "first_step_s": round(first - built, 2),
                "resume_s": round(time.perf_counter() - again, 2),
            }
        )
    return {"budget": args.unseen_budgets[0], "world_sizes": [4, 3], "runs": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--budget", type=float, default=65536)
    parser.add_argument("--mix-budgets", type=float, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--mix-world-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--unseen-budgets", type=float, nargs="+", default=[16384, 65536])
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=["text", "multimodal", "unseen", "resume"],
        default=["text", "multimodal", "unseen", "resume"],
    )
    args = parser.parse_args()
    sections = {
        "text": lambda: text_only(args, CostModel(video_fps=2.0)),
        "multimodal": lambda: multimodal(args),
        "unseen": lambda: unseen(args),
        "resume": lambda: resume_cost(args),
    }
    results = {name: sections[name]() for name in args.sections}
    print(
        json.dumps({"samples": args.samples, "world_size": args.world_size, "budget": args.budget, **results}, indent=1)
    )


if __name__ == "__main__":
    main()
