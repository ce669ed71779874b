"""`omnifeed bench` at full size, its report and plot kept beside RESULTS.md.

    .venv-peers/bin/python benchmarks/bench_loaders.py [--images 2048] [--mixed 1536] [--workers 2] [--rounds 2]
                                                       [--resume-samples 10000000]

Run by ``make bench-loaders`` in the venv that holds every peer loader (see the Makefile).
Writes ``benchmarks/results-bench.json`` and ``benchmarks/bench.png``; the generated 10M-sample
index and MDS dataset of the resume comparison stay in ``benchmarks/_work/resume-cache``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from omnifeed.tools._bench import bench_command
from omnifeed.tools._bench_config import BenchConfig

HERE = Path(__file__).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--mixed", type=int, default=1536)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--resume-samples", type=int, default=10_000_000)
    args = parser.parse_args()
    work = HERE / "_work" / "bench"
    config = BenchConfig(work=work, images=args.images, mixed=args.mixed, workers=args.workers, rounds=args.rounds)
    status = bench_command(config, resume_samples=args.resume_samples, resume_work=HERE / "_work" / "resume-cache")
    shutil.copyfile(work / "report.json", HERE / "results-bench.json")
    if (work / "bench.png").exists():
        shutil.copyfile(work / "bench.png", HERE / "bench.png")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
