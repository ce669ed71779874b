"""The checks and the summary of `omnifeed chaos`: exactly-once per committed step, leaks, resource figures.

`verify_audit` runs ``verify_coverage`` over the service's audit log for every epoch the run
touched: the epochs the job finished must be delivered exactly once (the resume markers roll
back what was delivered after a checkpoint and never committed); the epoch the last step
spilled into must hold no duplicate. `Verdict.ok` is true only when that holds, no sample was
replaced, nothing unexpected happened, every kind of fault was injected, no ``omnifeed*``
segment was left in /dev/shm and no process of the run outlived it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from omnifeed.loader import SampleIndex, verify_coverage

from ._chaos_schedule import KINDS

_METRICS = ("rss", "fds", "threads", "children", "children_rss")


def _rolled_back(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, int]:
    """The delivery records a verifier keeps; how many resume markers rolled back; how many were logged twice.

    The rule of ``verify_coverage``: a delivery logged twice in one attempt (step, rank,
    accumulation micro-step, micro-batch, topology, ``since``) counts once, a returned one not at all; a marker at
    (step, accum_done) drops the earlier records of that step or later from other attempts.
    """
    kept: dict[tuple[Any, ...], dict[str, Any]] = {}
    dropped = twice = 0
    for line, record in enumerate(records):
        if "resume" in record:
            at = (int(record["step"]), int(record.get("accum_done", 0)))
            before = len(kept)
            spared = {record["resume"], *record.get("live", ())}
            kept = {k: r for k, r in kept.items() if r.get("since") in spared or (r["step"], r["accum"]) < at}
            dropped += before - len(kept)
        elif "returned" in record:  # received ahead and given back unused: not a delivery
            fields = ("step", "rank", "accum", "micro_batch")
            kept.pop((*(record[f] for f in fields), record.get("topology_version"), record["returned"]), None)
        elif "since" in record:
            key = (
                record["step"],
                record["rank"],
                record["accum"],
                record["micro_batch"],
                record.get("topology_version"),
                record["since"],
            )
            twice += key in kept
            kept.setdefault(key, record)
        else:
            kept[(line, "line")] = record
    return list(kept.values()), dropped, twice


def verify_audit(index: SampleIndex, records: list[dict[str, Any]], complete_epochs: int) -> dict[str, Any]:
    """Per epoch touched: ``verify_coverage``'s report, and whether it passes (see the module docstring)."""
    kept, dropped, twice = _rolled_back(records)
    deliveries = [r for r in records if "resume" not in r and "returned" not in r]
    epochs = sorted({int(r["epoch"]) for r in deliveries} | set(range(complete_epochs)))
    reports = []
    for epoch in epochs:
        report = verify_coverage(index, epoch, records).to_json()
        complete = epoch < complete_epochs
        report["complete"] = complete
        report["passed"] = (
            report["ok"] if complete else (report["duplicates"] == report["unknown"] == report["partial"] == 0)
        )
        reports.append(report)
    replaced = Counter(str(item[2]) for r in kept for item in r.get("replaced") or [])
    return {
        "records": len(deliveries),
        "resume_markers": sum("resume" in r for r in records),
        "logged_twice": twice,
        "rolled_back": dropped,
        "epochs": reports,
        "replaced": dict(replaced),
        "samples_verified": sum(r["delivered"] for r in reports if r["complete"]),
    }


class Resources:
    """The service's resource figures sampled during the run, with the service start and epoch of each."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._started = time.monotonic()

    def add(self, start: int, epoch: int, row: dict[str, Any]) -> None:
        """One sample of the service started ``start``-th, during ``epoch``."""
        self.rows.append({"t": round(time.monotonic() - self._started, 1), "start": start, "epoch": epoch, **row})

    def summary(self) -> dict[str, Any]:
        """First, last and largest value of each figure; the longest-lived service's; the last sample per epoch."""
        if not self.rows:
            return {}
        out: dict[str, Any] = {"samples": len(self.rows), "overall": _spread(self.rows)}
        starts = Counter(r["start"] for r in self.rows)
        longest = max(starts, key=lambda s: starts[s])
        lived = [r for r in self.rows if r["start"] == longest]
        out["longest_lived"] = {"start": longest, "seconds": lived[-1]["t"] - lived[0]["t"], **_spread(lived)}
        per_epoch: dict[int, dict[str, Any]] = {}
        for row in self.rows:
            per_epoch[row["epoch"]] = row
        out["per_epoch"] = list(per_epoch.values())
        return out


def _spread(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    return {m: {"start": rows[0][m], "end": rows[-1][m], "max": max(r[m] for r in rows)} for m in _METRICS}


@dataclass
class Verdict:
    """Everything the soak measured and checked."""

    config: dict[str, Any]
    seconds: float
    tally: dict[str, Any]
    audit: dict[str, Any]
    resources: dict[str, Any]
    shm_leaked: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        """Why the run failed (empty: it passed)."""
        out = list(self.tally["unexpected"])
        missing = [k for k in KINDS if not self.tally["injected"].get(k)]
        if missing:
            out.append(f"not injected: {', '.join(missing)}")
        if not self.tally["storage"].get("errors_503"):
            out.append("no storage error was injected")
        for report in self.audit["epochs"]:
            if not report["passed"]:
                out.append(
                    f"epoch {report['epoch']}: {report['duplicates']} duplicates, {report['missing']} missing, "
                    f"{report['unknown']} unknown ({'complete' if report['complete'] else 'spill'}); "
                    f"examples {report['examples']}"
                )
        if self.audit["replaced"]:
            out.append(
                f"samples replaced (a fault reached the trainer as a substitute sample): {self.audit['replaced']}"
            )
        if not self.tally["epochs"]:
            out.append("no epoch was delivered")
        if self.shm_leaked:
            out.append(f"leaked /dev/shm segments: {self.shm_leaked}")
        if self.orphans:
            out.append(f"orphan processes: {self.orphans}")
        return out

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return not self.failures()

    def to_json(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict, with ``ok`` and ``failures``."""
        return {**asdict(self), "ok": self.ok, "failures": self.failures()}


_LABELS = {
    "service_kill": "service killed (kill -9), restarted",
    "worker_kill": "decode worker process killed (kill -9)",
    "trainer_kill": "trainer rank killed (kill -9), job restarted",
    "resize": "resize (job restarted at a new size)",
    "latency_spike": "storage latency spike",
}


def render(verdict: Verdict) -> str:
    """The human-readable summary (docs/chaos.md explains each line)."""
    tally, audit, storage = verdict.tally, verdict.audit, verdict.tally["storage"]
    lines = [
        "",
        "== omnifeed chaos summary",
        f"ran {verdict.seconds:.0f} s (seed {verdict.config['seed']}, {verdict.config['samples']} samples, "
        f"world sizes {verdict.config['world_sizes']}); {tally['jobs']} job starts, {tally['epochs']} epochs delivered",
        "faults injected (the run went on after each; failures listed below):",
    ]
    for kind, label in _LABELS.items():
        extra = f"  {' '.join(tally['resizes'])}" if kind == "resize" and tally["resizes"] else ""
        lines.append(f"  {label:<46}{tally['injected'].get(kind, 0):>6}{extra}")
    requests = max(1, storage.get("requests", 0))
    lines.append(
        f"  {'storage 503 answers':<46}{storage.get('errors_503', 0):>6}  of {storage.get('requests', 0)} "
        f"requests ({storage.get('errors_503', 0) / requests:.1%}); the service retried "
        f"{storage.get('service_retries', 0)} (counts of killed services are partly lost)"
    )
    lines.append(
        f"  {'requests slowed by spikes':<46}{storage.get('slowed', 0):>6}  degraded flag flipped "
        f"{storage.get('service_degraded_changes', 0)} times"
    )
    lines.append(
        f"audit: {audit['records']} delivery records, {audit['resume_markers']} resume markers, "
        f"{audit['rolled_back']} uncommitted deliveries rolled back, {audit['logged_twice']} logged twice "
        "(re-sent after a service restart, counted once)"
    )
    for report in audit["epochs"]:
        kind = "complete" if report["complete"] else "spill   "
        lines.append(
            f"  epoch {report['epoch']:>3} {kind} delivered {report['delivered']:>5} of {report['samples']}, "
            f"duplicates {report['duplicates']}, missing {report['missing']}  "
            f"{'ok' if report['passed'] else 'FAILED'}"
        )
    lines.append(
        f"samples verified exactly once: {audit['samples_verified']}; replaced: {sum(audit['replaced'].values())}"
    )
    resources = verdict.resources
    if resources:
        lines.append(f"service resources ({resources['samples']} samples, 1 s apart): start / end / max")
        for scope in ("overall", "longest_lived"):
            figures = resources[scope]
            title = (
                "whole run"
                if scope == "overall"
                else (f"longest-lived service (start {figures['start']}, {figures['seconds']:.0f} s)")
            )
            lines.append(f"  {title}:")
            lines.append("    " + "; ".join(_figure(m, figures[m]) for m in ("rss", "fds", "threads", "children_rss")))
        lines.append(
            "  per epoch (last sample; @s: which service start): "
            + ", ".join(
                f"e{r['epoch']}@s{r['start']}: {r['rss'] / 2**20:.0f} MiB/{r['fds']} fds/{r['threads']} thr"
                for r in resources["per_epoch"]
            )
        )
    lines.append(
        f"leaks: /dev/shm omnifeed* segments {len(verdict.shm_leaked)}, orphan processes {len(verdict.orphans)}"
    )
    failures = verdict.failures()
    lines += [f"FAILED: {f}" for f in failures] or ["OK: every check passed"]
    return "\n".join(lines)


def _figure(name: str, spread: dict[str, int]) -> str:
    if name.endswith("rss"):
        label = "RSS" if name == "rss" else "workers RSS"
        return f"{label} {spread['start'] / 2**20:.0f}/{spread['end'] / 2**20:.0f}/{spread['max'] / 2**20:.0f} MiB"
    return f"{name} {spread['start']}/{spread['end']}/{spread['max']}"


def service_storage(snapshots: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Origin reads, retries and errors the service counted, summed over its starts (the last snapshot of each)."""
    totals: dict[str, int] = {}
    for snapshot in snapshots:
        remote = snapshot.get("cache", {}).get("remote", {})
        for name in ("reads", "retries", "errors", "degraded_changes"):
            totals[f"service_{name}"] = totals.get(f"service_{name}", 0) + int(remote.get(name, 0))
    return totals
