"""Resume cost side by side: mid-epoch resume at a large position for omnifeed, torchdata and Streaming.

Per loader, two fresh processes (``python -m omnifeed.tools._bench_resume``, one JSON line each):

- ``save``: builds the dataset representation if it is not cached under ``work`` (``build_s``),
  takes a state at position ``fraction × samples`` (rounded down to whole batches) of epoch 0,
  shuffled, with seed 0, and the first batch an uninterrupted run yields after it (``expected``).
- ``resume``: opens the dataset (``open_s``: the process now has the dataset object), reads the
  saved state, then times ``load_state_dict`` + the first batch (``resume_s``) while sampling its
  own resident memory (``peak_rss_mib``; psutil every 2 ms, else the ``ru_maxrss`` high-water mark),
  and checks the batch against ``expected`` (``first_batch_ok``).

What each loader's "first batch" is: omnifeed — the plan cursor's next micro-batch and its sample
keys from the index (plan + index lookup; ``feed_resume_s`` adds a whole ``Feed`` with every image
decoded); torchdata ``StatefulDataLoader`` — the collated batch of a map-style dataset whose item is
its own index; Streaming — the first ``batch_size`` samples of ``StreamingDataset`` (an MDS dataset
of one int column). How each state was had is the row's ``how``.

Each loader's phases are in `_bench_resume_omnifeed`, `_bench_resume_torchdata` and
`_bench_resume_streaming`; what they share (timing, peak RSS, the expected batch) in `_bench_resume_measure`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._bench_resume_measure import Missing
from ._bench_resume_omnifeed import omnifeed_resume, omnifeed_save
from ._bench_resume_streaming import streaming_resume, streaming_save
from ._bench_resume_torchdata import torchdata_resume, torchdata_save

LOADERS = ("omnifeed", "torchdata", "streaming")


# -- the parent --------------------------------------------------------------------------------
def run_resume_bench(
    work: Path,
    samples: int = 10_000_000,
    fraction: float = 0.5,
    batch_size: int = 64,
    loaders: Sequence[str] = LOADERS,
    python: str | Mapping[str, str] = sys.executable,
    torchdata_workers: Sequence[int] = (0, 2),
    timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """One row per loader (per worker count for torchdata), each measured in fresh subprocesses."""
    rows = []
    for loader in loaders:
        interpreter = python if isinstance(python, str) else python.get(loader, sys.executable)
        for workers in torchdata_workers if loader == "torchdata" else (0,):
            options = {
                "work": work / (loader if not workers else f"{loader}-w{workers}"),
                "samples": samples,
                "fraction": fraction,
                "batch_size": batch_size,
                "workers": workers,
            }
            rows.append(loader_row(loader, interpreter, options, timeout_s))
    return rows


def loader_row(loader: str, python: str, options: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """The save then the resume phase of one loader, merged into its row."""
    row: dict[str, Any] = {
        "loader": loader,
        "workers": options["workers"],
        "samples": options["samples"],
        "position": None,
        "open_s": None,
        "resume_s": None,
        "peak_rss_mib": None,
        "state_bytes": None,
        "python": python,
    }
    for phase in ("save", "resume"):
        result = child(python, phase, loader, options, timeout_s)
        row.update(result)
        if result["status"] != "ok":
            break
    return row


def child(python: str, phase: str, loader: str, options: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """One phase in a fresh process: its JSON line, or a status saying why there is none."""
    command = [
        python,
        "-m",
        "omnifeed.tools._bench_resume",
        "--phase",
        phase,
        "--loader",
        loader,
        *(f"--{k.replace('_', '-')}={v}" for k, v in options.items()),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return {"status": f"missing: no interpreter {python}"}
    except subprocess.TimeoutExpired:
        return {"status": f"error: {phase} phase ran past {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"error: {phase} phase exited {done.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- the subprocess ----------------------------------------------------------------------------
PHASES = {
    ("omnifeed", "save"): omnifeed_save,
    ("omnifeed", "resume"): omnifeed_resume,
    ("torchdata", "save"): torchdata_save,
    ("torchdata", "resume"): torchdata_resume,
    ("streaming", "save"): streaming_save,
    ("streaming", "resume"): streaming_resume,
}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The subprocess's options."""
    parser = argparse.ArgumentParser(prog="python -m omnifeed.tools._bench_resume", description=__doc__.split("\n")[0])
    parser.add_argument("--phase", choices=("save", "resume"), required=True)
    parser.add_argument("--loader", choices=LOADERS, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (torchdata only)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one phase of one loader and print its result as one JSON line."""
    options = parse(argv)
    try:
        result = PHASES[(options.loader, options.phase)](options)
    except Missing as exc:
        result = {"status": f"missing: {exc}"}
    except Exception as exc:  # a loader may fail any way it likes; the row says how
        result = {"status": f"error: {options.phase}: {type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
