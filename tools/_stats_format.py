"""How `omnifeed stats` writes figures: bytes, milliseconds, durations, percentages, rates, counts,
the remote tier's latency percentile, and aligned tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._stats_interval import num


def fmt_bytes(n: float | None) -> str:
    """Bytes with a binary unit (B, KiB, ... TiB); "-" for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_ms(seconds: float | None) -> str:
    """Seconds as milliseconds; "-" for None."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def fmt_duration(seconds: float | None) -> str:
    """Seconds as 5s, 3m07s or 2h05m; "-" for None."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def fmt_pct(share: float | None) -> str:
    """A share as a whole percentage; "-" for None."""
    return "-" if share is None else f"{100 * share:.0f}%"


def fmt_rate(value: float | None) -> str:
    """A rate with one decimal; "-" for None."""
    return "-" if value is None else f"{value:.1f}"


def fmt_count(value: float | None) -> str:
    """A count, whole; "-" for None."""
    return "-" if value is None else f"{value:.0f}"


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The header and rows as lines of left-aligned columns, two spaces apart."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def remote_latency(remote: Mapping[str, Any]) -> tuple[str, float | None]:
    """The highest percentile below p99 the remote tier reports (p95, else p90, else p50)."""
    for key in ("p95", "p90", "p50"):
        if (value := num(remote, "latency_s", key)) is not None:
            return key, value
    return "p50", None
