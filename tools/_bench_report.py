"""How `omnifeed bench` shows its report: Markdown tables and one PNG (throughput and resume cost per loader)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def render_table(report: dict[str, Any]) -> str:
    """The report as a Markdown table per pipeline (what `omnifeed bench` prints)."""
    lines = []
    for pipeline, limit in report["decode_limit"].items():
        draft = f"; draft mode {limit['draft_limit_samples_per_s']:.0f}" if "draft_limit_samples_per_s" in limit else ""
        lines += [
            f"\n{pipeline}: decode limit {limit['limit_samples_per_s']:.0f} samples/s "
            f"({limit['one_core_samples_per_s']:.0f} per core × {limit['workers']} workers{draft})\n",
            "| loader | samples/s | CPU ms/sample | first batch s | peak PSS MiB | vs DataLoader | vs decode limit |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in (r for r in report["rows"] if r["pipeline"] == pipeline):
            if row["status"] != "ok":
                lines.append(f"| {row['loader']} | {row['status']} | | | | | |")
                continue
            ratio = f"{row['vs_dataloader']:.2f}×" if row["vs_dataloader"] is not None else "—"
            limit_ratio = f"{row['vs_decode_limit']:.2f}" if row["vs_decode_limit"] is not None else "—"
            lines.append(
                f"| {row['loader']} | {row['samples_per_s']:.0f} | {row['cpu_s_per_sample'] * 1e3:.1f} | "
                f"{row['first_batch_s']:.2f} | {row['peak_pss_mib']:.0f} | {ratio} | {limit_ratio} |"
            )
    if report.get("node"):
        lines += [
            "\nnode: trainer ranks on one node, one service against a DataLoader per rank (image pipeline; "
            "dp: data-parallel ranks, rate summed; tp: tensor-parallel peers of one rank, a step's rate)\n",
            "| layout | ranks | loader | samples/s | per rank | first batch s | service start s | vs DataLoader |",
            "|---|---:|---|---:|---|---:|---:|---:|",
        ]
        for row in report["node"]:
            if row["status"] != "ok":
                lines.append(f"| {row['layout']} | {row['ranks']} | {row['loader']} | {row['status']} | | | | |")
                continue
            start = f"{row['service_start_s']:.2f}" if row.get("service_start_s") is not None else "—"
            ratio = f"{row['vs_dataloader']:.2f}×" if row.get("vs_dataloader") is not None else "—"
            per_rank = " / ".join(f"{r:.0f}" for r in row["rank_samples_per_s"])
            lines.append(
                f"| {row['layout']} | {row['ranks']} | {row['loader']} | {row['samples_per_s']:.0f} | {per_rank} | "
                f"{row['first_batch_s']:.2f} | {start} | {ratio} |"
            )
    return "\n".join(lines)


def render_resume(rows: list[dict[str, Any]]) -> str:
    """The resume-cost rows as a Markdown table."""
    lines = [
        "\nresume mid-epoch (time from a fresh process holding the dataset to the first batch after the saved "
        "position)\n",
        "| loader | samples | position | resume s | peak RSS MiB | state bytes | open s | status |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if row.get("status") != "ok":
            lines.append(f"| {_resume_name(row)} | {row.get('samples', '')} | | | | | | {row.get('status')} |")
            continue
        lines.append(
            f"| {_resume_name(row)} | {row['samples']:,} | {row['position']:,} | {row['resume_s']:.3f} | "
            f"{row['peak_rss_mib']:.0f} | {row['state_bytes']:,} | {row['open_s']:.2f} | ok |"
        )
    return "\n".join(lines)


def _resume_name(row: dict[str, Any]) -> str:
    return f"{row['loader']} ({row['workers']} workers)" if row.get("workers") else str(row["loader"])


def write_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Throughput per loader and pipeline (with the decode limit) and resume time per loader, as one PNG; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    resume = [r for r in report.get("resume", []) if r.get("status") == "ok"]
    pipelines = list(report["decode_limit"])
    fig, axes = plt.subplots(
        1, len(pipelines) + (1 if resume else 0), figsize=(6 * (len(pipelines) + 1), 4.5), squeeze=False
    )
    for ax, pipeline in zip(axes[0], pipelines):
        rows = [r for r in report["rows"] if r["pipeline"] == pipeline and r["status"] == "ok"]
        names = [r["loader"] for r in rows]
        colors = ["tab:blue" if n.startswith("omnifeed") else "tab:gray" for n in names]
        ax.barh(names, [r["samples_per_s"] for r in rows], color=colors)
        limit = report["decode_limit"][pipeline]["limit_samples_per_s"]
        ax.axvline(limit, color="tab:red", linestyle="--", label=f"decode limit {limit:.0f}/s")
        ax.set_xlabel("samples/s (steady state, one epoch)")
        ax.set_title(f"{pipeline} pipeline, {report['settings']['workers']} workers")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
    if resume:
        ax = axes[0][-1]
        ax.barh(
            [_resume_name(r) for r in resume],
            [r["resume_s"] for r in resume],
            color=["tab:blue" if r["loader"].startswith("omnifeed") else "tab:gray" for r in resume],
        )
        ax.set_xscale("log")
        ax.set_xlabel("seconds to the first batch after resume (log)")
        ax.set_title(f"resume at sample {resume[0]['position']:,} of {resume[0]['samples']:,}")
        ax.invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scenario_command(
    work: Path,
    run: Callable[[Callable[[str], None]], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], Path | None],
    plot_name: str,
) -> int:
    """A scenario of `omnifeed bench` end to end: ``work`` made the output folder, ``run`` (progress to stderr), its
    table on stdout, ``report.json`` and the plot ``plot_name`` under ``work``."""
    from ._output_dir import prepare_output_dir

    prepare_output_dir(work, "bench")
    report = run(lambda line: print(line, file=sys.stderr, flush=True))
    print(render(report), flush=True)
    (work / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    drawn = plot(report, work / plot_name)
    print(
        f"\nreport: {work / 'report.json'}"
        + (f"; plot: {drawn}" if drawn else "; no plot (matplotlib is not installed)")
    )
    return 0
