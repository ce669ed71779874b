"""`omnifeed bench`: omnifeed beside the loaders a user would otherwise pick, on one machine, in one run.

The parent prepares the dataset in every form the loaders read (WebDataset shards, a folder
of files, omnifeed's index, each peer's own format), measures the decode limit (one core's
decode rate × workers), then runs each loader × pipeline for one epoch in a fresh child
process (`_bench_loaders`), sampling the child's process tree for its peak memory (PSS, so
shared memory is counted once). Rounds alternate the loaders so the machine's noise hits all
alike; a loader that is not installed is reported as missing, one that fails as an error.
The config and the rows are `_bench_config`; the dataset's forms `_bench_dataset`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from ._bench_config import BenchConfig, Row
from ._bench_dataset import Dataset, prepare_datasets
from ._bench_loaders import IMAGE_ONLY, REQUIRES
from ._bench_node import run_node
from ._bench_spec import RunSpec, SampleDecoder, decode_config, folder_samples


# -- the decode limit ---------------------------------------------------------------------------
def decode_limit(dataset: Dataset, workers: int, seconds: float = 3.0) -> dict[str, float]:
    """One core's rate of the pipeline's decode (files already in memory) × ``workers``: what no loader can beat.

    For images also the limit of omnifeed's own image path (JPEG draft mode), which `omnifeed-draft` runs.
    """
    items = folder_samples(dataset.folder)
    loaded = [(Path(k).name, {n: p.read_bytes() for n, p in files.items()}) for k, files in items[:256]]
    rate = _one_core_rate(loaded, SampleDecoder(decode_config(dataset.pipeline)), seconds)
    limit = {
        "one_core_samples_per_s": round(rate, 1),
        "workers": workers,
        "limit_samples_per_s": round(rate * workers, 1),
    }
    if dataset.pipeline == "image":
        draft = _one_core_rate(loaded, SampleDecoder(decode_config("image", draft=True)), seconds)
        limit["draft_limit_samples_per_s"] = round(draft * workers, 1)
    return limit


def _one_core_rate(loaded: list[tuple[str, dict[str, bytes]]], decode: SampleDecoder, seconds: float) -> float:
    decode(loaded[0][1], loaded[0][0])  # warm: decoders built, libraries loaded
    done, cpu0, start = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - start < seconds or done < len(loaded):
        key, fields = loaded[done % len(loaded)]
        decode(fields, key)
        done += 1
    return done / (time.process_time() - cpu0)  # per CPU second: one core's rate even on a busy machine


# -- one child run ------------------------------------------------------------------------------
def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _TreeMemory:
    """Peak PSS of a process and its descendants, sampled every 0.5 s on a thread (reading smaps_rollup of a
    process with a thousand mappings costs ~30 ms of CPU: sampled every 0.1 s, it took a third of a core from
    the loader being measured)."""

    def __init__(self, pid: int) -> None:
        self.root, self.peak = psutil.Process(pid), 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.5):
            try:
                pids = [self.root.pid] + [c.pid for c in self.root.children(recursive=True)]
            except psutil.Error:
                continue
            self.peak = max(self.peak, sum(_pss(p) for p in pids))

    def stop(self) -> int:
        """Stop sampling; the peak in bytes."""
        self._done.set()
        self._thread.join()
        return self.peak


def installed(loader: str, python: str) -> str | None:
    """None when ``loader`` can run under ``python``, else why not."""
    module = REQUIRES.get(loader)
    if module is None:
        return None
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    if probe.returncode:
        lines = probe.stderr.strip().splitlines() or ["import failed"]
        return f"missing: {lines[-1][:160]}"
    return None


def _child(python: str, spec: RunSpec, prepare: bool, timeout: float) -> tuple[dict[str, Any], int]:
    args = (
        [python, "-m", "omnifeed.tools._bench_loaders"]
        + (["--prepare"] if prepare else [])
        + [json.dumps(asdict(spec))]
    )
    child = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    memory = _TreeMemory(child.pid)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise RuntimeError(f"timed out after {timeout:.0f} s") from None
    finally:
        peak = memory.stop()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if child.returncode or not lines:
        tail = (err.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"exit {child.returncode}: {tail[:300]}")
    return json.loads(lines[-1]), peak


def run_all(config: BenchConfig, datasets: dict[str, Dataset], log: Any = None) -> list[Row]:
    """Every loader × pipeline, ``rounds`` times, alternating; medians per row."""
    rows: dict[tuple[str, str], Row] = {}
    missing = {loader: installed(loader, config.python) for loader in config.loaders}
    for pipeline in config.pipelines:
        dataset = datasets[pipeline]
        for loader in config.loaders:
            row = rows[(loader, pipeline)] = Row(loader, pipeline)
            if pipeline != "image" and loader in IMAGE_ONLY:
                row.status = "n/a: image pipeline only"
            elif missing[loader]:
                row.status = str(missing[loader])
    specs = {}
    for (loader, pipeline), row in rows.items():
        if row.status != "ok":
            continue
        dataset = datasets[pipeline]
        work = config.work / "runs" / f"{loader}-{pipeline}"
        work.mkdir(parents=True, exist_ok=True)
        converted = (
            str(config.work / "converted" / f"{loader}-{pipeline}") if loader in ("streaming", "litdata") else ""
        )
        specs[(loader, pipeline)] = RunSpec(
            loader,
            pipeline,
            config.workers,
            config.batch_size,
            dataset.shards,
            dataset.folder,
            dataset.index,
            str(work),
            converted,
            dataset.samples,
        )
        if converted and not Path(converted).exists():
            try:
                _child(config.python, specs[(loader, pipeline)], True, config.timeout_s)
            except RuntimeError as exc:
                row.status = f"error: preparing its format: {exc}"
    for round_ in range(config.rounds):
        order = list(specs) if round_ % 2 == 0 else list(reversed(specs))
        for key in order:
            row = rows[key]
            if row.status != "ok":
                continue
            try:
                result, peak = _child(config.python, specs[key], False, config.timeout_s)
            except RuntimeError as exc:
                row.status = f"error: {exc}"
                continue
            result["peak_pss_mib"] = round(peak / 2**20, 1)
            row.rounds.append(result)
            if log is not None:
                log(f"{key[1]:6} {key[0]:18} {result['steady_samples'] / max(result['steady_s'], 1e-9):8.1f} samples/s")
    return [_summarize(row) for row in rows.values()]


def _summarize(row: Row) -> Row:
    if row.status != "ok" or not row.rounds:
        return row
    rates = [r["steady_samples"] / max(r["steady_s"], 1e-9) for r in row.rounds]
    row.samples = row.rounds[0]["samples"]
    row.samples_per_s = round(statistics.median(rates), 1)
    row.cpu_s_per_sample = round(
        statistics.median(r["steady_cpu_s"] / max(r["steady_samples"], 1) for r in row.rounds), 5
    )
    row.first_batch_s = round(statistics.median(r["first_batch_s"] for r in row.rounds), 3)
    row.peak_pss_mib = round(max(r["peak_pss_mib"] for r in row.rounds), 1)
    return row


def add_ratios(rows: list[Row], limits: dict[str, dict[str, float]]) -> None:
    """Each row's throughput over DataLoader's on the same pipeline, and over the decode limit."""
    base = {r.pipeline: r.samples_per_s for r in rows if r.loader == "dataloader" and r.status == "ok"}
    for row in rows:
        if row.status != "ok":
            continue
        if base.get(row.pipeline):
            row.vs_dataloader = round(row.samples_per_s / base[row.pipeline], 3)
        limit = limits.get(row.pipeline, {}).get("limit_samples_per_s")
        if limit:
            row.vs_decode_limit = round(row.samples_per_s / limit, 3)


def run_bench(config: BenchConfig, log: Any = None) -> dict[str, Any]:
    """Prepare, measure the decode limits, run every loader; the whole report as one JSON-able dict."""
    config.work.mkdir(parents=True, exist_ok=True)
    datasets = prepare_datasets(config)
    limits = {p: decode_limit(d, config.workers, config.limit_seconds) for p, d in datasets.items()}
    rows = run_all(config, datasets, log)
    add_ratios(rows, limits)
    node: list[dict[str, Any]] = []
    if config.node_ranks > 0 and "image" in datasets and {"dataloader", "omnifeed-service"} <= set(config.loaders):
        image = datasets["image"]
        work = config.work / "runs" / "node"
        work.mkdir(parents=True, exist_ok=True)
        spec = RunSpec(
            "omnifeed-service",
            "image",
            config.workers,
            config.batch_size,
            image.shards,
            image.folder,
            image.index,
            str(work),
            "",
            image.samples,
        )
        node = run_node(spec, config.node_ranks, config.rounds, config.python, log)
    return {
        "machine": {"cpus": os.cpu_count(), "python": config.python},
        "settings": {
            "images": config.images,
            "mixed": config.mixed,
            "workers": config.workers,
            "batch_size": config.batch_size,
            "rounds": config.rounds,
            "data": str(config.data) if config.data else "generated",
        },
        "decode_limit": limits,
        "rows": [{k: v for k, v in asdict(r).items() if k != "rounds"} | {"rounds": len(r.rounds)} for r in rows],
        "node": node,
    }


def bench_command(config: BenchConfig, resume_samples: int = 10_000_000, resume_work: Path | None = None) -> int:
    """`omnifeed bench`: throughput rows, the resume-cost rows, report.json and bench.png under ``config.work``.

    ``resume_work`` keeps the resume comparison's generated index and MDS dataset between runs
    (minutes to write at 10M samples); by default they live under ``config.work``."""
    from ._bench_report import render_resume, render_table, write_plot
    from ._bench_resume import run_resume_bench
    from ._output_dir import prepare_output_dir

    prepare_output_dir(config.work, "bench")
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    report = run_bench(config, log)
    print(render_table(report), flush=True)
    if resume_samples > 0:
        log(f"resume cost at {resume_samples:,} samples (the first run writes the index and the MDS dataset)")
        report["resume"] = run_resume_bench(
            resume_work or config.work / "resume",
            samples=resume_samples,
            batch_size=config.batch_size,
            python=config.python,
        )
        print(render_resume(report["resume"]), flush=True)
    (config.work / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    plot = write_plot(report, config.work / "bench.png")
    print(
        f"\nreport: {config.work / 'report.json'}"
        + (f"; plot: {plot}" if plot else "; no plot (matplotlib is not installed)")
    )
    return 0 if any(r["status"] == "ok" for r in report["rows"]) else 1
