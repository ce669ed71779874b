"""Mixtures (issue 31): cursor state and resume at 100 sources × 10M samples, and the single-index path's cost.

``--sections scale``: a mixture of 100 sources of 10M samples each (synthetic lengths from a hash
of the position: no index is written), fixed batches and a cost budget: plan built, first step,
state size, resume (a new plan, the state loaded, the next step), each in this process.
``--sections shares``: three generated sources (photos, documents, speech) at 0.5 / 0.3 / 0.2 under a budget:
each source's share over every run of 1,000 micro-batches, and the steps' balance.
``--sections single``: one index of ``--samples`` samples, no mixture, fixed batches and a budget:
the same timings, to run before and after a change (the single-index plan is not a mixture of one:
it keeps its own stream, so a mixture adds one ``if`` to it).

    python benchmarks/bench_mixture.py [--sections scale single] [--samples 2000000]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from omnifeed.bucketing import BucketingConfig, CostModel
from omnifeed.loader.plan import MixtureConfig, Plan, PlanConfig, PlanCursor, mixture_stream
from omnifeed.tools._bench_scale import synthetic_lengths as synthetic

COST = CostModel(video_fps=2.0, video_max_frames=16)


def timed(run: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = run()
    return out, round(time.perf_counter() - start, 3)


def measure(make: Callable[[], Plan], world_size: int, steps: int = 3) -> dict[str, Any]:
    """Plan built, first step, state size, and a resume (new plan, state loaded, next step)."""
    plan, built = timed(make)
    cursor = PlanCursor(plan, world_size=world_size)
    _, first = timed(cursor.next_step)
    for _ in range(steps):
        cursor.next_step()
    state = json.dumps(cursor.state_dict())

    def resume() -> None:
        again = PlanCursor(make(), world_size=world_size // 2)
        again.load_state_dict(json.loads(state))
        again.next_step()

    _, resumed = timed(resume)
    return {"plan_built_s": built, "first_step_s": first, "state_bytes": len(state), "resume_s": resumed}


def scale(args: argparse.Namespace) -> list[dict[str, Any]]:
    names = [f"source-{i:03d}" for i in range(args.sources)]
    mixture = MixtureConfig(sources={n: {"index": n, "weight": 1 + i % 7} for i, n in enumerate(names)})
    sizes = [args.source_samples] * args.sources
    out = []
    for label, extra in (
        ("fixed batches of 8", {}),
        ("budget 16,384", {"bucketing": BucketingConfig(budget=16384, cost=COST, overlong="alone")}),
    ):
        config = PlanConfig(seed=1, mixture=mixture, **extra)

        def make(config: PlanConfig = config) -> Plan:
            stream = mixture_stream(mixture, sizes, config.seed)
            return Plan(stream.num_samples, config, index_fingerprint="bench", lengths=synthetic, mixture=stream)

        out.append({"sources": args.sources, "samples": sum(sizes), "batching": label, **measure(make, 64)})
    return out


def single(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for label, extra in (
        ("fixed batches of 8", {}),
        ("budget 16,384", {"bucketing": BucketingConfig(budget=16384, cost=COST, overlong="alone")}),
    ):
        config = PlanConfig(seed=1, **extra)

        def make(config: PlanConfig = config) -> Plan:
            return Plan(args.samples, config, index_fingerprint="bench", lengths=synthetic)

        runs = [measure(make, 64) for _ in range(args.repeats)]
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        out.append({"samples": args.samples, "batching": label, **best})
    return out


def source_lengths(sizes: list[int], seed: int = 0) -> dict[str, np.ndarray]:
    """Three sources one after another: photos with captions, documents, speech with transcripts (log-normal)."""
    rng = np.random.default_rng(seed)
    kind = np.concatenate([np.full(n, i % 3) for i, n in enumerate(sizes)])
    n = kind.size
    talk = np.clip(rng.lognormal(2.0, 0.8, n), 0.2, 600)
    documents = np.clip(rng.lognormal(5.5, 1.0, n), 1, 65536)
    captions = np.clip(rng.lognormal(2.5, 0.5, n), 1, 1024)
    side, ratio = np.clip(rng.lognormal(6.3, 0.5, n), 32, 6000), np.exp(rng.normal(0, 0.3, n))
    zeros = np.zeros(n)
    return {
        "text_tokens": np.where(kind == 1, documents, np.where(kind == 2, talk * 3, captions)).astype(np.int64),
        "image_width": np.where(kind == 0, np.round(side * ratio), 0),
        "image_height": np.where(kind == 0, np.round(side / ratio), 0),
        "audio_seconds": np.where(kind == 2, talk, 0),
        **{c: zeros for c in ("video_frames", "video_fps", "video_width", "video_height")},
    }


def shares(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Interleaved by progress and in cost tiers only: the shares over 1,000 micro-batches and the steps' balance."""
    return [_shares(args, interleave) for interleave in (True, False)]


def _shares(args: argparse.Namespace, interleave: bool) -> dict[str, Any]:
    """Each source's sample share over every run of 1,000 micro-batches of one epoch, and the steps' balance."""
    sizes, weights = [args.share_samples] * 3, [0.5, 0.3, 0.2]
    mixture = MixtureConfig(
        sources={n: {"index": n, "weight": w} for n, w in zip(("photos", "docs", "speech"), weights)},
        interleave=interleave,
    )
    columns = source_lengths(sizes)
    config = PlanConfig(seed=3, mixture=mixture, bucketing=BucketingConfig(budget=16384, cost=COST, overlong="alone"))
    stream = mixture_stream(mixture, sizes, config.seed)
    plan = Plan(
        stream.num_samples,
        config,
        index_fingerprint="bench",
        lengths=lambda p: {k: v[p] for k, v in columns.items()},
        mixture=stream,
    )
    cursor, dealt, ratios = PlanCursor(plan, world_size=8), [], []
    while not cursor.epoch_delivered(0):
        step = cursor.next_step()
        dealt.extend(mb for mb in step.micro_batches if mb.epoch == 0)
        if not any(mb.ends_epoch for mb in step.micro_batches):
            costs = [mb.cost for mb in step.micro_batches]
            ratios.append(max(costs) / float(np.mean(costs)))
    starts = np.cumsum([0, *sizes])
    per = np.array([np.bincount(np.searchsorted(starts, mb.positions, side="right") - 1, minlength=3) for mb in dealt])
    worst = np.zeros(3)
    for a in range(0, max(1, len(dealt) - 1000 + 1), 10):
        counts = per[a : a + 1000].sum(axis=0)
        worst = np.maximum(worst, np.abs(counts / counts.sum() - weights))
    return {
        "interleave": interleave,
        "samples_per_source": args.share_samples,
        "micro_batches": len(dealt),
        "holding_two_sources_or_more": int(((per > 0).sum(axis=1) > 1).sum()),
        "worst_share_deviation_pp": [round(float(x) * 100, 2) for x in worst],
        "steps_over_1_15": int(sum(r > 1.15 for r in ratios)),
        "steps": len(ratios),
        "worst_step_over_mean": round(max(ratios), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sections", nargs="+", choices=["scale", "single", "shares"], default=["scale", "single", "shares"]
    )
    parser.add_argument("--share-samples", type=int, default=60_000)
    parser.add_argument("--sources", type=int, default=100)
    parser.add_argument("--source-samples", type=int, default=10_000_000)
    parser.add_argument("--samples", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sections = {"scale": scale, "single": single, "shares": shares}
    print(json.dumps({name: sections[name](args) for name in args.sections}, indent=1))


if __name__ == "__main__":
    main()
