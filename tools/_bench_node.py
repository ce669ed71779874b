"""The node scenario of `omnifeed bench`: several trainer ranks on one node, one service against a DataLoader per rank.

Two layouts of ``ranks`` trainer processes:

- ``dp``: data-parallel ranks, each with its own share of the epoch;
- ``tp``: tensor-parallel peers of one data-parallel rank: every peer needs the same batches.

A ``torch.utils.data.DataLoader`` per rank (``DistributedSampler`` over the dataset, ``workers``
worker processes each, what each rank's training script would build) decodes its own rank's
batches: peers decode the same samples once each. One ``omnifeed serve`` for the node
(``workers`` decode threads in all, started before the ranks; its start is reported apart)
decodes each batch once and hands it to every peer. The ranks are processes of their own that
build their loader, wait for one "go", then take one epoch. The scenario's rate is what
reaches training per second (after each rank's first batch): the sum of the data-parallel
ranks' rates; a peer group's rate is its slowest peer's (a step needs every peer).

    python -m omnifeed.tools._bench_node RANK_SPEC_JSON     (a rank; the parent runs it)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ._bench_loaders import batch_size_of, start_service
from ._bench_spec import RunSpec

LAYOUTS = ("dp", "tp")
NODE_LOADERS = ("dataloader", "omnifeed-service")


@dataclass(frozen=True)
class RankSpec:
    """One trainer rank of a node scenario."""

    layout: str
    loader: str
    rank: int
    ranks: int
    run: dict[str, Any]  # the RunSpec of the pipeline (dataset forms, workers, batch size), as a dict
    socket: str = ""


def _rank_loader(spec: RankSpec) -> Iterable[Any]:
    run = RunSpec(**spec.run)
    dp_world, dp_rank = (spec.ranks, spec.rank) if spec.layout == "dp" else (1, 0)
    if spec.loader == "dataloader":
        import torch.utils.data

        from ._bench_peers import FolderDataset
        from ._bench_spec import collate_samples

        dataset = FolderDataset(run.folder, run.pipeline)
        sampler = torch.utils.data.DistributedSampler(  # type: ignore[var-annotated]
            dataset,  # type: ignore[arg-type]
            num_replicas=dp_world,
            rank=dp_rank,
            shuffle=True,
            seed=0,
            drop_last=False,
        )
        return torch.utils.data.DataLoader(
            dataset,  # type: ignore[arg-type]
            batch_size=run.batch_size,
            sampler=sampler,
            num_workers=run.workers,
            collate_fn=collate_samples,
        )
    from omnifeed.trainer_adapter import FeedClient

    return FeedClient(spec.socket, rank=spec.rank, world_size=spec.ranks, dp_rank=dp_rank, dp_world_size=dp_world)


def run_rank(spec: RankSpec) -> dict[str, Any]:
    """Build the loader, say ready, wait for "go" on stdin, take one epoch: samples and seconds after the first
    batch."""
    loader = _rank_loader(spec)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    samples, first_at, first_samples = 0, 0.0, 0
    for batch in loader:
        n = batch_size_of(batch)
        if not samples:
            first_at, first_samples = time.perf_counter(), n
        samples += n
        del batch
    end = time.perf_counter()
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return {
        "rank": spec.rank,
        "samples": samples,
        "first_batch_s": round(first_at - start, 3),
        "steady_s": round(end - first_at, 3),
        "steady_samples": samples - first_samples,
    }


def _start_service(run: RunSpec, work: Path, python: str) -> tuple[subprocess.Popen[bytes], str, float]:
    started = time.perf_counter()
    service, socket = start_service(run, work, python)
    return service, socket, time.perf_counter() - started


def run_scenario(
    layout: str, loader: str, ranks: int, run: RunSpec, python: str = sys.executable, timeout_s: float = 1800.0
) -> dict[str, Any]:
    """``ranks`` rank processes of ``layout`` on ``loader``, started together: the scenario's row."""
    service, socket, service_start_s = None, "", None
    if loader == "omnifeed-service":
        service, socket, service_start_s = _start_service(run, Path(run.work) / f"node-{layout}", python)
    children = []
    try:
        for rank in range(ranks):
            spec = RankSpec(layout, loader, rank, ranks, asdict(run), socket)
            children.append(
                subprocess.Popen(
                    [python, "-m", "omnifeed.tools._bench_node", json.dumps(asdict(spec))],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for child in children:  # every rank built its loader (and connected) before any starts
            assert child.stdout is not None
            line = child.stdout.readline()
            if line.strip() != "ready":
                _, err = child.communicate(timeout=60)
                raise RuntimeError(f"a {loader} rank did not start: {(err.strip().splitlines() or ['no output'])[-1]}")
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        results = []
        for child in children:
            out, err = child.communicate(timeout=timeout_s)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if child.returncode or not lines:
                raise RuntimeError(f"a {loader} rank failed: {(err.strip().splitlines() or ['no output'])[-1][:300]}")
            results.append(json.loads(lines[-1]))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        if service is not None:
            service.terminate()
            service.wait(timeout=60)
    rates = [r["steady_samples"] / max(r["steady_s"], 1e-9) for r in results]
    rate = sum(rates) if layout == "dp" else min(rates)
    return {
        "layout": layout,
        "loader": loader,
        "ranks": ranks,
        "samples_per_s": round(rate, 1),
        "rank_samples_per_s": [round(r, 1) for r in rates],
        "samples": [r["samples"] for r in results],
        "first_batch_s": max(r["first_batch_s"] for r in results),
        "service_start_s": None if service_start_s is None else round(service_start_s, 3),
    }


def run_node(
    run: RunSpec, ranks: int, rounds: int = 1, python: str = sys.executable, log: Any = None
) -> list[dict[str, Any]]:
    """Every layout × loader, ``rounds`` times alternating; medians, and each omnifeed row over DataLoader's."""
    import statistics

    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    order = [(layout, loader) for layout in LAYOUTS for loader in NODE_LOADERS]
    for round_ in range(rounds):
        for layout, loader in order if round_ % 2 == 0 else list(reversed(order)):
            try:
                result = run_scenario(layout, loader, ranks, run, python)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                result = {"layout": layout, "loader": loader, "ranks": ranks, "status": f"error: {exc}"}
            rows.setdefault((layout, loader), []).append(result)
            if log is not None and "samples_per_s" in result:
                log(f"node {layout} ×{ranks} {loader:18} {result['samples_per_s']:8.1f} samples/s")
    summary = []
    for (layout, loader), results in rows.items():
        ok = [r for r in results if "samples_per_s" in r]
        if not ok:
            summary.append(results[-1])
            continue
        row = dict(ok[0])
        row["samples_per_s"] = round(statistics.median(r["samples_per_s"] for r in ok), 1)
        row["status"], row["rounds"] = "ok", len(ok)
        summary.append(row)
    base = {r["layout"]: r["samples_per_s"] for r in summary if r["loader"] == "dataloader" and r["status"] == "ok"}
    for row in summary:
        if row["status"] == "ok" and base.get(row["layout"]):
            row["vs_dataloader"] = round(row["samples_per_s"] / base[row["layout"]], 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    """A rank's entry point: ``RANK_SPEC_JSON``."""
    args = sys.argv[1:] if argv is None else argv
    print(json.dumps(run_rank(RankSpec(**json.loads(args[-1])))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
