"""A budget's epoch written ahead at any size, then dealt and resumed in a fresh interpreter (issue 32).

Writes epoch 0 of the scale scenario's budget plan (`omnifeed bench --scenario scale`: synthetic lengths from a
hash of the position, budget 16,384, ``overlong: alone``) over ``--samples`` positions under ``--out`` (what
``omnifeed plan --write-epochs 1`` does for an index), reporting the writer's CPU, wall time and peak resident
memory; then, in a fresh interpreter, for dp 64 × 1 and 4,096 × 16: the dealing CPU a step per local rank (8 local
ranks, 20 steps after 5), and a resume (a new plan, the state loaded, one step): CPU, wall, resident memory added,
the process's resident memory at the end, and how many stream positions were planned live (0: all by look-up).

``--mixture``: the same over a budgeted mixture of three sources of those lengths (50 / 30 / 20 % of the
positions, weights 0.5 / 0.3 / 0.2 for the epoch's first half, then annealed to 0.2 / 0.3 / 0.5), written into
its config's ``plans`` folder (what ``omnifeed plan --config FILE --write-epochs 1`` does); beside it, the same
steps planned live (no files; each step bounded to ``--live-limit`` CPU seconds, a cut one reported as such).

    .venv/bin/python benchmarks/bench_planned_epochs.py --samples 1000000000 --out /tmp/planned-1e9   # ~1 h, 8.3 GB
    .venv/bin/python benchmarks/bench_planned_epochs.py --samples 20000000 --out /tmp/planned-mix --mixture
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORLDS = ((64, 1), (4096, 16))
LOCAL_RANKS = 8


def _plan(samples: int, folder: Path | None, mixture: bool = False) -> Any:
    from omnifeed.loader.plan import MixtureConfig, Plan, mixture_stream
    from omnifeed.tools._bench_scale import ScaleConfig, plan_config, synthetic_lengths

    config = plan_config("budget", ScaleConfig(work=folder or Path()))
    if not mixture:
        return Plan(samples, config, index_fingerprint="scale", lengths=synthetic_lengths, index_path=folder)
    sizes = [samples // 2, samples * 3 // 10, samples - samples // 2 - samples * 3 // 10]
    names = ("captions", "documents", "photos")
    blend = MixtureConfig(
        sources={n: {"index": n, "weight": w} for n, w in zip(names, (0.5, 0.3, 0.2))},
        phases=[
            {"until_samples": samples // 2, "weights": dict(zip(names, (0.5, 0.3, 0.2)))},
            {"weights": dict(zip(names, (0.2, 0.3, 0.5)))},
        ],
        plans=None if folder is None else str(folder),
    )
    stream = mixture_stream(blend, sizes, config.seed)
    config = config.model_copy(update={"mixture": blend})
    return Plan(
        stream.num_samples, config, index_fingerprint="scale-mixture", lengths=synthetic_lengths, mixture=stream
    )


def write(samples: int, folder: Path, mixture: bool) -> dict[str, Any]:
    """Epoch 0 written ahead under ``folder`` (kept when already there): the writer's figures."""
    from omnifeed.loader.plan import planned_epochs, write_planned_epochs

    plan = _plan(samples, folder, mixture)
    found = planned_epochs(plan)
    if found is not None and found.epoch(0) is not None:
        return {"micro_batches": found.epoch(0).size, "kept": True}  # type: ignore[union-attr]
    cpu, wall = time.process_time(), time.perf_counter()
    written: dict[str, Any] = {}
    where = None if mixture else folder  # a mixture's: its config's plans folder
    write_planned_epochs(plan, where, range(1), lambda epoch, count: written.update(micro_batches=count))
    return {
        **written,
        "cpu_s": round(time.process_time() - cpu, 1),
        "wall_s": round(time.perf_counter() - wall, 1),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "us_per_sample": round((time.process_time() - cpu) / samples * 1e6, 2),
    }


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _live_ms(samples: int, dp: int, accum: int, mixture: bool, limit_s: float) -> dict[str, Any]:
    """Two steps (after the first) planned live, no files: CPU a step per local rank, bounded to ``limit_s`` each."""
    from omnifeed.loader.plan import PlanCursor
    from omnifeed.tools._bench_scale import _deal

    cursor = PlanCursor(_plan(samples, None, mixture), world_size=dp, grad_accum=accum)
    first, done = _deal(cursor, limit_s, min(LOCAL_RANKS, dp))
    times = []
    while done and len(times) < 2:
        spent, done = _deal(cursor, limit_s, min(LOCAL_RANKS, dp))
        times.append(spent)
    spent_all = times or [first]
    return {
        "live_per_local_rank_ms": round(sum(spent_all) / len(spent_all) / min(LOCAL_RANKS, dp) * 1e3, 3),
        "live_cut": not done,
    }


def measure(samples: int, folder: Path, mixture: bool, live_limit: float) -> dict[str, Any]:
    """Dealing and a resume from the written epoch (run in a fresh interpreter); a mixture's also planned live."""
    from omnifeed.loader.plan import PlanCursor

    out: dict[str, Any] = {}
    for dp, accum in WORLDS:
        cursor = PlanCursor(_plan(samples, folder, mixture), world_size=dp, grad_accum=accum)
        for _ in range(5):
            cursor.next_step()
        start = time.process_time()
        for _ in range(20):
            step = cursor.next_step()
            for rank in range(min(LOCAL_RANKS, dp)):
                step.for_rank(rank)
        per_local_ms = (time.process_time() - start) / 20 / min(LOCAL_RANKS, dp) * 1e3
        state = json.dumps(cursor.state_dict())
        before, cpu, wall = _rss_mb(), time.process_time(), time.perf_counter()
        resumed = PlanCursor(_plan(samples, folder, mixture), world_size=dp, grad_accum=accum)
        resumed.load_state_dict(json.loads(state))
        resumed.next_step().for_rank(0)
        out[f"{dp}x{accum}"] = {
            "per_local_rank_ms": round(per_local_ms, 3),
            "resume_cpu_s": round(time.process_time() - cpu, 3),
            "resume_wall_s": round(time.perf_counter() - wall, 3),
            "resume_rss_added_mb": round(_rss_mb() - before, 1),
            "state_bytes": len(state),
            "planned_live_positions": resumed.plan.work,
            **(_live_ms(samples, dp, accum, mixture, live_limit) if mixture else {}),
        }
    out["rss_end_mb"] = round(_rss_mb(), 1)
    out["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000, help="positions of the epoch (default 10^7)")
    parser.add_argument("--out", type=Path, required=True, help="folder of the written epoch (kept across runs)")
    parser.add_argument("--mixture", action="store_true", help="a budgeted mixture of three sources, annealed")
    parser.add_argument("--live-limit", type=float, default=120.0, help="CPU seconds a live step may take (mixture)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the fresh interpreter's part
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.samples, args.out, args.mixture, args.live_limit)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "samples": args.samples,
        "mixture": args.mixture,
        "write": write(args.samples, args.out, args.mixture),
    }
    flags = ["--mixture"] if args.mixture else []
    fresh = subprocess.run(
        [
            sys.executable,
            __file__,
            "--samples",
            str(args.samples),
            "--out",
            str(args.out),
            "--measure",
            "--live-limit",
            str(args.live_limit),
            *flags,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report["dealt"] = json.loads(fresh.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
