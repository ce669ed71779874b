"""How the scale scenario of `omnifeed bench` shows its report: one Markdown table and one PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _cell(value: Any, unit: str = "", cut: bool = False) -> str:
    if value is None:
        return "—"
    text = f"{value:,.3f}{unit}" if isinstance(value, float) else f"{value:,}{unit}"
    return f"≥ {text}" if cut else text


def render_scale(report: dict[str, Any]) -> str:
    """The cells as a Markdown table, then the index's figures (what the scenario prints)."""
    settings, targets = report["settings"], report["targets"]
    lines = [
        f"\nscale: planning CPU of a node over its ranks (process time), {settings['local_ranks']} local ranks a node; "
        f"targets: ≤ {targets['per_local_rank_ms']} ms a step per local rank, resume ≤ {targets['resume_s']} s, "
        f"state ≤ {targets['state_bytes']} bytes, resize ≤ {targets['resize_s']} s; "
        f"load average {report['machine']['load_average']}\n",
        "| samples | batching | dp × accum | first step s | ms a step per local rank | steps | state bytes "
        "| resume s | resize s (to dp) | RSS MB |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["cells"]:
        cut = set(c["cut"])
        lines.append(
            f"| {c['samples']:,} | {c['batching']} | {c['dp']:,} × {c['accum']} "
            f"| {_cell(c['first_step_s'], cut='first_step' in cut)} "
            f"| {_cell(c.get('per_local_rank_ms'), cut='steps' in cut)} | {c['steps']} "
            f"| {_cell(c.get('state_bytes'))} | {_cell(c.get('resume_s'), cut='resume' in cut)} "
            f"| {_cell(c.get('resize_s'), cut='resize' in cut)} ({c.get('resize_to_dp', '—')}) | {c['rss_mb']:.0f} |"
        )
    index = report.get("index")
    for size in (index or {}).get("sizes", [index] if index else []):
        if "error" in size:
            lines.append(f"\nindex of {size['rows']:,} rows: {size['error']}")
            continue
        plans = "; ".join(
            f"{name}: plan {size[name]['plan_s']:.3f} s, first step {size[name]['first_step_s']:.3f} s, "
            f"resume {size[name]['resume_s']:.3f} s"
            + (" (epoch 0 written ahead)" if size[name].get("written_ahead") else "")
            for name in ("fixed", "budget")
            if name in size
        )
        lines.append(
            f"\nindex of {size['rows']:,} rows: opened in {size['open_s']:.3f} s, +{size['rss_open_mb']:.1f} MB "
            f"resident; one lookup {size['lookup_s'] * 1e3:.1f} ms, +{size['rss_lookup_mb']:.1f} MB after it; {plans}"
        )
    if index and index.get("projection"):
        p = index["projection"]
        lines.append(f"Projection to {p['rows']:,} rows ({p['how']}): open {p['open_s']} s, {p['rss_open_mb']} MB")
    return "\n".join(lines)


def write_scale_plot(report: dict[str, Any], path: Path) -> Path | None:
    """Per-step dealing CPU per local rank against dp (log-log), fixed vs budget (live and written ahead), each
    accum; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cells = [c for c in report["cells"] if c.get("per_local_rank_ms") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), squeeze=False)
    colors = {"fixed": "tab:gray", "budget": "tab:blue", "budget-written": "tab:orange"}
    for ax, (key, label, target) in zip(
        axes[0],
        (
            ("per_local_rank_ms", "dealing CPU a step per local rank (ms)", report["targets"]["per_local_rank_ms"]),
            ("resume_s", "resume CPU: new plan + state + one step (s)", report["targets"]["resume_s"]),
        ),
    ):
        for samples in sorted({c["samples"] for c in cells}):
            for batching in colors:
                for accum in sorted({c["accum"] for c in cells}):
                    rows = sorted(
                        (
                            c
                            for c in cells
                            if (c["samples"], c["batching"], c["accum"]) == (samples, batching, accum)
                            and c[key] is not None
                        ),
                        key=lambda c: c["dp"],
                    )
                    if not rows:
                        continue
                    style = "-" if accum == 1 else "--"
                    ax.plot(
                        [c["dp"] for c in rows],
                        [c[key] for c in rows],
                        style,
                        marker="o",
                        color=colors[batching],
                        label=f"{batching}, accum {accum}"
                        + (f", {samples:.0e} samples" if len(set(c["samples"] for c in cells)) > 1 else ""),
                    )
                    for c in rows:
                        if ("steps" if key == "per_local_rank_ms" else "resume") in c["cut"]:  # a lower bound
                            ax.plot([c["dp"]], [c[key]], marker="^", color="tab:red", markersize=9)
        ax.axhline(target, color="tab:green", linestyle=":", label="issue 32 target")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("data-parallel world size")
        ax.set_ylabel(label)
        ax.set_title(label + "; red ▲: cut (lower bound)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
