"""What `omnifeed index` prints when it is done: a human summary, or one JSON object with ``--json``.

The human summary says where the index is, how many samples of each modality it holds, their
length ranges (as the demo prints them), the class names of ImageFolder labels, and how many
samples were left out as damaged and sources refused (each named on stderr).
"""

from __future__ import annotations

from typing import Any

from omnifeed.loader import MODALITIES, IndexReport, SampleIndex

_LENGTH_NAMES = {
    "text_tokens": "text tokens",
    "image_width": "image width px",
    "image_height": "image height px",
    "video_frames": "video frames",
    "video_fps": "video fps",
    "video_width": "video width px",
    "video_height": "video height px",
    "audio_seconds": "audio seconds",
    "audio_sample_rate": "audio rate Hz",
}
_CLASSES_SHOWN = 8


def summary_json(report: IndexReport) -> dict[str, Any]:
    """The one-object summary of ``--json``: index, samples, shards, fingerprint, errors, damaged, classes."""
    return {
        "index": str(report.path),
        "samples": report.num_samples,
        "shards": report.shards,
        "fingerprint": report.fingerprint,
        "errors": len(report.errors),
        "damaged": len(report.damaged),
        "classes": len(report.classes),
    }


def length_table(manifest: dict[str, Any]) -> list[str]:
    """Samples per modality and each length's min/p50/p90/max, from an index's manifest."""
    counts = manifest.get("modalities", {})
    lines = ["samples with: " + ", ".join(f"{m} {counts.get(m, 0):,}" for m in MODALITIES)]
    lengths = manifest.get("lengths", {})
    if lengths:
        lines.append(f"  {'length':<18}{'min':>10}{'p50':>10}{'p90':>10}{'max':>10}")
        for name, stats in lengths.items():
            lines.append(
                f"  {_LENGTH_NAMES.get(name, name):<18}"
                + "".join(f"{stats[k]:>10.5g}" for k in ("min", "p50", "p90", "max"))
            )
    return lines


def summary_lines(report: IndexReport) -> list[str]:
    """The human summary of a finished build."""
    manifest = SampleIndex(report.path).manifest
    shards = f"{report.shards} shard{'s' if report.shards != 1 else ''}"
    lines = [
        f"omnifeed: indexed {report.num_samples:,} samples from {shards} into {report.path}",
        f"fingerprint {report.fingerprint}",
        *length_table(manifest),
    ]
    if not any(manifest.get("modalities", {}).get(m) for m in MODALITIES):
        lines.append("no sample has an image, video, audio or text field: every field is meta")
    if report.classes:
        shown = ", ".join(report.classes[:_CLASSES_SHOWN])
        more = f" and {len(report.classes) - _CLASSES_SHOWN} more" if len(report.classes) > _CLASSES_SHOWN else ""
        lines.append(
            f"labels: field 'label' (int64), {len(report.classes)} classes from the class folders: {shown}{more}"
        )
    if report.damaged:
        reasons: dict[str, int] = {}
        for entry in report.damaged:
            reasons[entry["reason"]] = reasons.get(entry["reason"], 0) + 1
        by_reason = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
        lines.append(f"damaged: {len(report.damaged)} left out ({by_reason}), named above")
    else:
        lines.append("damaged: 0")
    if report.errors:
        lines.append(f"refused: {len(report.errors)} source(s) or key(s), named above")
    return lines
