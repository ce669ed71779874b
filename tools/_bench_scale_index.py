"""The index side of the scale scenario: a synthetic index opened, planned over and resumed from, at each size.

Each size is a synthetic index (`_synthetic_index.make_index`, kept in ``--index-cache`` across runs, else made
under the run's folder) measured
in a fresh interpreter, after a tiny index was opened first so the first open's imports are not
counted: the open (time, resident memory added), one lookup, then per batching (fixed batches of 8,
a cost budget) the plan built from the index, its first step (a budget plans its first window) and a
resume from the state after it (a new plan, the state loaded, one step); at the end, resident memory
added in all (``rss_end_mb``, the mapped index's pages that were read included: they are the node's page
cache, shared by its processes) and of the process's own (``anon_end_mb``). The projection to 10⁹ rows
runs through the two largest sizes (a line; from one size, proportional to rows), stated as one.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

PROJECTED_ROWS = 1_000_000_000

_OPEN_CODE = """
import json, os, sys, time
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
def anon():  # resident memory of this process's own (not the mapped index's pages, shared through the page cache)
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith('RssAnon:')) / 1024
from omnifeed.bucketing import BucketingConfig
from omnifeed.loader import SampleIndex
from omnifeed.loader.plan import Plan, PlanConfig, PlanCursor, planned_epochs
SampleIndex(sys.argv[2]).sample(0)  # a tiny index first: the first open's imports are not the index's cost
before, before_anon = rss(), anon()
start = time.perf_counter()
index = SampleIndex(sys.argv[1])
out = {"rows": len(index), "open_s": time.perf_counter() - start, "rss_open_mb": rss() - before}
start = time.perf_counter()
index.sample(len(index) // 2)
out.update(lookup_s=time.perf_counter() - start, rss_lookup_mb=rss() - before)
configs = {"fixed": PlanConfig(seed=1, batch_size=8),
           "budget": PlanConfig(seed=1, bucketing=BucketingConfig(budget=16384, overlong="alone"))}
for name, config in configs.items():
    start = time.perf_counter()
    plan = Plan.from_index(index, config)
    built = time.perf_counter()
    cursor = PlanCursor(plan, world_size=64)
    cursor.next_step().for_rank(0)
    stepped = time.perf_counter()
    state = json.dumps(cursor.state_dict())
    resumed = PlanCursor(Plan.from_index(index, config), world_size=64)
    resumed.load_state_dict(json.loads(state))
    resumed.next_step().for_rank(0)
    out[name] = {"plan_s": built - start, "first_step_s": stepped - built,
                 "resume_s": time.perf_counter() - stepped, "state_bytes": len(state),
                 "written_ahead": planned_epochs(plan) is not None and planned_epochs(plan).epoch(0) is not None}
out.update(rss_end_mb=rss() - before, anon_end_mb=anon() - before_anon)
print(json.dumps(out))
"""


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def measure_index_size(folder: Path, rows: int, python: str) -> dict[str, Any]:
    """One synthetic index of ``rows`` rows (made under ``folder``, or taken from there when made before): open,
    lookup, plan and resume figures (wall seconds), or its error."""
    from ._synthetic_index import make_index

    folder.mkdir(parents=True, exist_ok=True)
    path, how = make_index(folder, rows)
    done = subprocess.run(
        [python, "-c", _OPEN_CODE, str(path), str(folder / "template-index")],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        return {"rows": rows, "error": done.stderr[-500:], **how}
    return {**_rounded(json.loads(done.stdout.splitlines()[-1])), **how}


def projection(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """Open time and memory at `PROJECTED_ROWS`, through the two largest sizes measured (or from one)."""
    measured = sorted((s for s in sizes if "error" not in s), key=lambda s: s["rows"])
    if not measured:
        return {}
    if len(measured) == 1:
        scale = PROJECTED_ROWS / measured[0]["rows"]
        return {
            "rows": PROJECTED_ROWS,
            "how": f"proportional to rows from {measured[0]['rows']:,}, not measured",
            "open_s": round(measured[0]["open_s"] * scale, 2),
            "rss_open_mb": round(measured[0]["rss_open_mb"] * scale, 1),
        }
    a, b = measured[-2], measured[-1]

    def line(key: str) -> float:
        slope = (b[key] - a[key]) / (b["rows"] - a["rows"])
        return max(b[key], b[key] + slope * (PROJECTED_ROWS - b["rows"]))

    return {
        "rows": PROJECTED_ROWS,
        "how": f"a line through {a['rows']:,} and {b['rows']:,} rows, not measured",
        "open_s": round(line("open_s"), 2),
        "rss_open_mb": round(line("rss_open_mb"), 1),
    }
