"""The training scenario of `omnifeed bench`: a simulated synchronous data-parallel job fed by each loader.

``ranks`` rank processes on one node (`_bench_training_rank`) each take a batch, "compute" for
``c`` seconds per padded token (a sleep, as a GPU kernel leaves the CPU free), and meet at a
barrier (the all-reduce). The same four-modality mix, decode and cores for every loader
(`_bench_training_data`):

- ``dataloader``: a ``torch.utils.data.DataLoader`` per rank over the folder of files, a
  ``DistributedSampler``, ``batch_size`` samples padded to the longest, ``workers / ranks``
  worker processes each;
- ``omnifeed``: the feed in each rank's process (``FeedClient.in_process``), budget-mode plan at
  the budget `omnifeed plan --suggest-budget BATCH_SIZE` prints, ``workers / ranks`` decode threads each;
- ``omnifeed-service``: one `omnifeed serve` for the node, a ``FeedClient`` per rank; its streams make
  their batches in a producer process each (``producers: auto``), ``workers / ranks`` decode threads each.

Three compute points: none (the loader's own rate), *data-heavy* (``c`` such that the DataLoader's
compute per step is half its production time per step) and *compute-heavy* (6 × that ``c``). Every
loader runs without compute first, ``rounds`` times in alternating order, after ``warmup_runs`` DataLoader
runs that count for nothing; ``c`` comes from the median of the DataLoader's runs among them (its own
production time, measured in the same minutes as the others'); then the two compute points, ``rounds``
times alternated. Medians are reported.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ._bench_training_data import TrainingData, feed_config, write_training_data
from ._bench_training_rank import TRAINING_LOADERS, TrainingRankSpec, rank_process

POINTS = ("no-compute", "data-heavy", "compute-heavy")
COMPUTE_HEAVY_FACTOR = 6.0  # compute-heavy c over data-heavy c
DATA_HEAVY_SHARE = 0.5  # data-heavy: the DataLoader's compute per step over its production time per step
PEERS = {"litdata": "litdata", "energon": "megatron.energon"}
FIGURES = ("useful_util", "util", "stall", "barrier_imbalance", "barrier_stall", "padding")


@dataclass(frozen=True)
class TrainingConfig:
    """What the training scenario runs."""

    work: Path
    samples: int = 1024
    ranks: int = 2
    workers: int = 2  # decode workers of the node, every loader alike
    batch_size: int = 8
    rounds: int = 3
    warmup_runs: int = 1  # DataLoader runs without compute before the rounds, not counted (the first one runs slow)
    python: str = sys.executable
    timeout_s: float = 900.0


def _start_service(service: dict[str, Any], work: Path, python: str) -> tuple[subprocess.Popen[bytes], str]:
    """`omnifeed serve` of this ServiceConfig (its socket moved under ``work``); returns once it answers."""
    import yaml

    from omnifeed.loader.service import MAX_SOCKET_PATH, wait_until_serving

    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o700)  # the service refuses a socket directory other users can enter
    socket, config = work / "feed.sock", work / "service.yaml"
    if len(os.fsencode(socket)) > MAX_SOCKET_PATH:
        socket = Path(tempfile.mkdtemp(prefix="omnifeed-bench-")) / "feed.sock"
    config.write_text(yaml.safe_dump({**service, "socket": str(socket)}), encoding="utf-8")
    process = subprocess.Popen(
        [python, "-m", "omnifeed.tools", "serve", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_until_serving(
        str(socket),
        process,
        120.0,
        detail=lambda: process.stderr.read().decode() if process.poll() is not None and process.stderr else "",
    )
    return process, str(socket)


def run_job(config: TrainingConfig, data: TrainingData, loader: str, seconds_per_token: float) -> list[dict[str, Any]]:
    """One epoch of the simulated job on ``loader``: each rank's step records."""
    import multiprocessing

    threads = max(1, config.workers // config.ranks)  # the service's producers decode per rank, as the feeds do
    service = {
        "index": data.index,
        "feed": feed_config(data.budget["suggested_budget"], threads).model_dump(mode="json"),
        "socket": str(config.work / "unused.sock"),
    }
    server, socket = None, ""
    if loader == "omnifeed-service":
        server, socket = _start_service(service, config.work / "service", config.python)
    context = multiprocessing.get_context("spawn")
    barrier, done, results = (
        context.Barrier(config.ranks, timeout=config.timeout_s),
        context.Array("i", config.ranks),
        context.Queue(),
    )
    processes = []
    try:
        for rank in range(config.ranks):
            spec = TrainingRankSpec(
                loader,
                rank,
                config.ranks,
                config.batch_size,
                max(1, config.workers // config.ranks),
                data.folder,
                service,
                seconds_per_token,
                socket,
                server.pid if server is not None else 0,
            )
            processes.append(context.Process(target=rank_process, args=(spec, barrier, done, results)))
            processes[-1].start()
        out = [results.get(timeout=config.timeout_s) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join()
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    errors = sorted((r["error"] for r in out if "error" in r), key=lambda e: e.startswith("BrokenBarrierError"))
    if errors:
        raise RuntimeError(errors[0])
    return sorted(out, key=lambda r: r["rank"])


def job_figures(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's figures from its ranks' step records (the first step, start-up, left out).

    Per step and rank, the barrier wait is split into *imbalance* (what it would be if no rank
    stalled: the slowest rank's compute minus this rank's) and *stall-induced* (the rest).
    Fractions are of the ranks' wall time together.
    """
    steps = min(len(r["steps"]) for r in ranks)
    total = {k: 0.0 for k in ("stall", "compute", "useful", "wait", "imbalance", "padded", "useful_tokens", "n")}
    for k in range(1, steps):
        rows = [r["steps"][k] for r in ranks]
        slowest = max(row[1] for row in rows)
        for stall, compute, wait, padded, useful, n in rows:
            imbalance = min(wait, max(0.0, slowest - compute))
            total["stall"] += stall
            total["compute"] += compute
            total["useful"] += compute * useful / padded if padded else 0.0
            total["wait"] += wait
            total["imbalance"] += imbalance
            total["padded"] += padded
            total["useful_tokens"] += useful
            total["n"] += n
    wall = sum(r["wall_s"] for r in ranks) or 1e-9
    return {
        "useful_util": round(total["useful"] / wall, 4),
        "util": round(total["compute"] / wall, 4),
        "stall": round(total["stall"] / wall, 4),
        "barrier_imbalance": round(total["imbalance"] / wall, 4),
        "barrier_stall": round((total["wait"] - total["imbalance"]) / wall, 4),
        "padding": round(1 - total["useful_tokens"] / total["padded"], 4) if total["padded"] else 0.0,
        "samples_per_s": round(total["n"] / (wall / len(ranks)), 1),
        "cpu_ms_per_sample": round(1e3 * sum(r["cpu_s"] for r in ranks) / max(total["n"], 1), 3),
        "steps": steps - 1,
        "samples": int(total["n"]),
        "padded_tokens_per_step": round(total["padded"] / max((steps - 1) * len(ranks), 1), 1),
        "step_s": round(wall / len(ranks) / max(steps - 1, 1), 5),
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose step time is the median of ``runs`` (the lower of the two middle ones for an even count)."""
    ordered = sorted(runs, key=lambda figures: float(figures["step_s"]))
    return ordered[(len(ordered) - 1) // 2]


def calibrate(figures: dict[str, Any]) -> dict[str, float]:
    """c of each point from the DataLoader's run without compute: data-heavy compute = half its production time a
    step."""
    data_heavy = DATA_HEAVY_SHARE * figures["step_s"] / max(figures["padded_tokens_per_step"], 1.0)
    return {"no-compute": 0.0, "data-heavy": data_heavy, "compute-heavy": COMPUTE_HEAVY_FACTOR * data_heavy}


def _peer_rows() -> list[dict[str, Any]]:
    rows = []
    for name, module in PEERS.items():
        found = importlib.util.find_spec(module.partition(".")[0]) is not None
        status = "n/a: installed, not wired into this scenario" if found else f"missing: no module named {module}"
        rows += [{"loader": name, "point": point, "status": status} for point in POINTS]
    return rows


def _median_row(loader: str, point: str, runs: list[dict[str, Any]], c: float) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"loader": loader, "point": point, "status": runs[-1]["error"] if runs else "not run"}
    row: dict[str, Any] = {"loader": loader, "point": point, "status": "ok", "seconds_per_token": c, "rounds": len(ok)}
    for key in ok[0]:
        values = [r[key] for r in ok]
        row[key] = statistics.median(values)
    return row


def run_training(config: TrainingConfig, log: Any = None) -> dict[str, Any]:
    """Generate the mix, run every loader without compute, calibrate c on the DataLoader's runs, then every loader
    at both compute points: ``rounds`` times each, alternated; the report."""
    config.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = write_training_data(config.work / "data", config.samples, config.batch_size)
    # c from the DataLoader's runs without compute, alternated with the other loaders' in the same minutes. One run
    # alone set c by whatever the host did then (33.8 against 24.0 ms a step an hour apart); three in a row right after
    # the data was written ran at 36-56 ms against 26 in the rounds after them (benchmarks/RESULTS.md).
    warmups = [job_figures(run_job(config, data, "dataloader", 0.0)) for _ in range(config.warmup_runs)]
    order = [(loader, point) for point in POINTS for loader in TRAINING_LOADERS]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {key: [] for key in order}
    seconds_per_token = {"no-compute": 0.0}

    def play(points: tuple[str, ...]) -> None:
        """Every loader at ``points``, ``rounds`` times in alternating order."""
        phase = [(loader, point) for loader, point in order if point in points]
        for round_ in range(config.rounds):
            for loader, point in phase if round_ % 2 == 0 else list(reversed(phase)):
                try:
                    figures = job_figures(run_job(config, data, loader, seconds_per_token[point]))
                except Exception as exc:  # one loader failing does not stop the others
                    figures = {"error": f"error: {type(exc).__name__}: {str(exc)[:300]}"}
                runs[(loader, point)].append(figures)
                if log is not None and "error" not in figures:
                    log(
                        f"round {round_ + 1} {point:13} {loader:16} useful util {figures['useful_util']:.2f} "
                        f"stall {figures['stall']:.2f} padding {figures['padding']:.2f} "
                        f"{figures['samples_per_s']:.0f} samples/s"
                    )
                elif log is not None:
                    log(f"round {round_ + 1} {point:13} {loader:16} {figures['error']}")

    play(POINTS[:1])
    calibrations = [r for r in runs[("dataloader", "no-compute")] if "error" not in r]
    if not calibrations:
        raise RuntimeError(f"the DataLoader failed without compute: {runs[('dataloader', 'no-compute')][-1]['error']}")
    calibration = median_run(calibrations)
    seconds_per_token = calibrate(calibration)
    if log is not None:
        each = ", ".join(f"{r['step_s'] * 1e3:.1f}" for r in calibrations)
        log(
            f"calibration: DataLoader {calibration['step_s'] * 1e3:.1f} ms a step without compute "
            f"(the median of its rounds: {each}), "
            f"{calibration['padded_tokens_per_step']:.0f} padded tokens a batch: c = "
            f"{seconds_per_token['data-heavy'] * 1e9:.0f} ns a token (data-heavy), "
            f"×{COMPUTE_HEAVY_FACTOR:.0f} compute-heavy"
        )
    play(POINTS[1:])
    rows = [_median_row(loader, point, runs[(loader, point)], seconds_per_token[point]) for loader, point in order]
    return {
        "machine": {"cpus": os.cpu_count(), "python": config.python},
        "settings": {
            **{k: v for k, v in asdict(config).items() if k not in ("work", "python")},
            "budget": data.budget,
            "seconds_per_token": seconds_per_token,
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        "calibration": calibration,
        "calibration_step_s": [r["step_s"] for r in calibrations],
        "warmup_step_s": [r["step_s"] for r in warmups],
        "rows": rows + _peer_rows(),
        "rounds": {f"{loader}/{point}": runs[(loader, point)] for loader, point in order},
    }


def training_command(config: TrainingConfig) -> int:
    """`omnifeed bench --scenario training`: the table on stdout, report.json and training.png under ``config.work``."""
    from ._bench_report import scenario_command
    from ._bench_training_report import render_training, write_training_plot

    return scenario_command(
        config.work, lambda log: run_training(config, log), render_training, write_training_plot, "training.png"
    )
