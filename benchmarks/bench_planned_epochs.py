"""A budget's epoch written ahead at any size, then dealt and resumed in a fresh interpreter (issue 32).

Writes epoch 0 of the scale scenario's budget plan (`omnifeed bench --scenario scale`: synthetic lengths from a
hash of the position, budget 16,384, ``overlong: alone``) over ``--samples`` positions under ``--out`` (what
``omnifeed plan --write-epochs 1`` does for an index), reporting the writer's CPU, wall time and peak resident
memory; then, in a fresh interpreter, for dp 64 × 1 and 4,096 × 16: the dealing CPU a step per local rank (8 local
ranks, 20 steps after 5), and a resume (a new plan, the state loaded, one step): CPU, wall, resident memory added,
the process's resident memory at the end, and how many stream positions were planned live (0: all by look-up).

    .venv/bin/python benchmarks/bench_planned_epochs.py --samples 1000000000 --out /tmp/planned-1e9   # ~1 h, 8.3 GB
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


def _plan(samples: int, folder: Path) -> Any:
    from omnifeed.loader.plan import Plan
    from omnifeed.tools._bench_scale import ScaleConfig, plan_config, synthetic_lengths

    config = plan_config("budget", ScaleConfig(work=folder))
    return Plan(samples, config, index_fingerprint="scale", lengths=synthetic_lengths, index_path=folder)


def write(samples: int, folder: Path) -> dict[str, Any]:
    """Epoch 0 written ahead under ``folder`` (kept when already there): the writer's figures."""
    from omnifeed.loader.plan import planned_epochs, write_planned_epochs

    plan = _plan(samples, folder)
    found = planned_epochs(plan)
    if found is not None and found.epoch(0) is not None:
        return {"micro_batches": found.epoch(0).size, "kept": True}  # type: ignore[union-attr]
    cpu, wall = time.process_time(), time.perf_counter()
    written: dict[str, Any] = {}
    write_planned_epochs(plan, folder, range(1), lambda epoch, count: written.update(micro_batches=count))
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


def measure(samples: int, folder: Path) -> dict[str, Any]:
    """Dealing and a resume from the written epoch (run in a fresh interpreter)."""
    from omnifeed.loader.plan import PlanCursor

    out: dict[str, Any] = {}
    for dp, accum in WORLDS:
        cursor = PlanCursor(_plan(samples, folder), world_size=dp, grad_accum=accum)
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
        resumed = PlanCursor(_plan(samples, folder), world_size=dp, grad_accum=accum)
        resumed.load_state_dict(json.loads(state))
        resumed.next_step().for_rank(0)
        out[f"{dp}x{accum}"] = {
            "per_local_rank_ms": round(per_local_ms, 3),
            "resume_cpu_s": round(time.process_time() - cpu, 3),
            "resume_wall_s": round(time.perf_counter() - wall, 3),
            "resume_rss_added_mb": round(_rss_mb() - before, 1),
            "state_bytes": len(state),
            "planned_live_positions": resumed.plan.work,
        }
    out["rss_end_mb"] = round(_rss_mb(), 1)
    out["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000, help="positions of the epoch (default 10^7)")
    parser.add_argument("--out", type=Path, required=True, help="folder of the written epoch (kept across runs)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the fresh interpreter's part
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.samples, args.out)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"samples": args.samples, "write": write(args.samples, args.out)}
    fresh = subprocess.run(
        [sys.executable, __file__, "--samples", str(args.samples), "--out", str(args.out), "--measure"],
        capture_output=True,
        text=True,
        check=True,
    )
    report["dealt"] = json.loads(fresh.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
