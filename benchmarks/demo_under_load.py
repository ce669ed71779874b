"""`omnifeed demo` in a loop with both CPUs busy: does it verify exactly once every time (issue 27)?

    .venv/bin/python benchmarks/demo_under_load.py --runs 10 [--hogs 2] [--skew]

Each run is the console script exactly as `make demo` starts it, in a fresh output folder, with
``--hogs`` processes spinning beside it for its whole duration. ``--skew`` runs the demo in-process
instead, with the test suite's skewed ranks (one starts seconds late, one is slow). Prints one JSON
line per run (status, seconds, the two verification lines) and a summary; exit 0 only if every run
verified.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HOG = "import time\nend = time.monotonic() + 3600\nwhile time.monotonic() < end:\n    pass\n"
_OK_PLAN = "OK: every sample of epoch 0 delivered exactly once"
_OK_SERVED = "OK: the service delivered epoch 0 exactly once"


def _skewed(phase: int, rank: int) -> list[str]:
    return {(0, 1): ["--start-delay", "6"], (2, 0): ["--step-delay", "0.3"], (2, 2): ["--start-delay", "3"]}.get(
        (phase, rank), []
    )


def _one_run(out: Path, skew: bool) -> tuple[int, str]:
    if skew:
        from omnifeed.tools._demo import run_demo

        report = io.StringIO()
        return run_demo(out, stream=report, rank_args=_skewed), report.getvalue()
    omnifeed = str(Path(sys.executable).with_name("omnifeed"))
    done = subprocess.run([omnifeed, "demo", "--out", str(out)], capture_output=True, text=True, timeout=1800)
    return done.returncode, done.stdout + done.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside each run")
    parser.add_argument("--skew", action="store_true", help="skewed ranks (in-process run_demo)")
    args = parser.parse_args()
    failures = 0
    seconds: list[float] = []
    for run in range(args.runs):
        work = Path(tempfile.mkdtemp(prefix="omnifeed-demo-loop-"))
        hogs = [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in range(args.hogs)]
        started = time.perf_counter()
        try:
            status, text = _one_run(work / "demo", args.skew)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        elapsed = time.perf_counter() - started
        seconds.append(elapsed)
        verified = status == 0 and _OK_PLAN in text and _OK_SERVED in text
        failures += not verified
        print(
            json.dumps(
                {
                    "run": run,
                    "status": status,
                    "verified": verified,
                    "seconds": round(elapsed, 1),
                    "coverage": [line for line in text.splitlines() if line.startswith('{"epoch"')],
                }
            ),
            flush=True,
        )
        if verified:
            shutil.rmtree(work, ignore_errors=True)
        else:
            (work / "output.txt").write_text(text, encoding="utf-8")
            print(f"run {run} failed; its report is {work / 'output.txt'}", file=sys.stderr)
    seconds.sort()
    print(
        json.dumps(
            {
                "runs": args.runs,
                "hogs": args.hogs,
                "skew": args.skew,
                "verified": args.runs - failures,
                "median_s": round(seconds[len(seconds) // 2], 1),
                "max_s": round(seconds[-1], 1),
            }
        )
    )
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
