"""How the training scenario of `omnifeed bench` shows its report: one Markdown table and one PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_POINT_TITLES = {"no-compute": "no compute", "data-heavy": "data-heavy", "compute-heavy": "compute-heavy"}


def render_training(report: dict[str, Any]) -> str:
    """The rows as a Markdown table, points in order, loaders within each (what the scenario prints)."""
    settings = report["settings"]
    c = settings["seconds_per_token"]
    budget = settings["budget"]
    lines = [
        f"\ntraining: {settings['ranks']} data-parallel ranks, "
        f"{settings['samples']:,} samples of the four-modality mix, "
        f"{settings['workers']} decode workers on the node; DataLoader batches of {settings['batch_size']}, omnifeed "
        f"budget {budget['suggested_budget']:.0f} tokens ({budget['samples_per_micro_batch']:.1f} samples a batch); "
        f"c = {c['data-heavy'] * 1e9:.0f} ns a padded token (data-heavy), "
        f"{c['compute-heavy'] * 1e9:.0f} (compute-heavy); "
        f"medians of {settings['rounds']} rounds\n",
        "| point | loader | useful util | util incl. padding | stall | barrier: imbalance | barrier: stall-induced "
        "| padding | samples/s | CPU ms/sample |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        point = _POINT_TITLES.get(row["point"], row["point"])
        if row["status"] != "ok":
            lines.append(f"| {point} | {row['loader']} | {row['status']} | | | | | | | |")
            continue
        useful, util = (
            ("—", "—") if row["point"] == "no-compute" else (f"{row['useful_util']:.2f}", f"{row['util']:.2f}")
        )
        lines.append(
            f"| {point} | {row['loader']} | {useful} | {util} | "
            f"{row['stall']:.0%} | {row['barrier_imbalance']:.1%} | {row['barrier_stall']:.1%} | "
            f"{row['padding']:.1%} | "
            f"{row['samples_per_s']:.0f} | {row['cpu_ms_per_sample']:.1f} |"
        )
    return "\n".join(lines)


def write_training_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Per compute point, each loader's wall time split into useful compute, padding, stall and barrier wait; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    points = ["data-heavy", "compute-heavy"]
    fig, axes = plt.subplots(1, len(points) + 1, figsize=(6 * (len(points) + 1), 4.6), squeeze=False)
    parts = (
        ("useful compute", lambda r: r["useful_util"], "tab:green"),
        ("padding compute", lambda r: r["util"] - r["useful_util"], "tab:olive"),
        ("stall", lambda r: r["stall"], "tab:red"),
        ("barrier: imbalance", lambda r: r["barrier_imbalance"], "tab:purple"),
        ("barrier: stall-induced", lambda r: r["barrier_stall"], "tab:pink"),
    )
    for ax, point in zip(axes[0], points):
        rows = [r for r in report["rows"] if r["point"] == point and r["status"] == "ok"]
        names = [r["loader"] for r in rows]
        left = [0.0] * len(rows)
        for label, value, color in parts:
            widths = [max(0.0, value(r)) for r in rows]
            ax.barh(names, widths, left=left, color=color, label=label)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("share of each rank's wall time")
        ax.set_title(f"{_POINT_TITLES[point]}: useful GPU utilisation is the green bar")
        ax.invert_yaxis()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(parts), fontsize=9)
    ax = axes[0][-1]
    rows = [r for r in report["rows"] if r["point"] == "no-compute" and r["status"] == "ok"]
    ax.barh(
        [r["loader"] for r in rows],
        [r["samples_per_s"] for r in rows],
        color=["tab:blue" if r["loader"].startswith("omnifeed") else "tab:gray" for r in rows],
    )
    ax.set_xlabel("samples/s with no compute (the loader's own rate)")
    ax.set_title(f"{report['settings']['ranks']} ranks, {report['settings']['workers']} decode workers")
    ax.invert_yaxis()
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
