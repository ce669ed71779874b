"""`omnifeed stats`: where the remote decode workers (Ray actors) run — one line per actor of the snapshot."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._stats_format import fmt_count, fmt_table
from ._stats_interval import num, submap

NODE_ID_SHOWN = 12  # leading characters of a Ray node id (56 hex digits) in the table


def actor_table(remote: Mapping[str, Any]) -> list[str]:
    """Per started actor: modality, node (Ray node id, shortened), IP, pid, state, fields decoded, lost; [] if none."""
    rows = []
    for name, m in sorted(submap(remote, "modalities").items()):
        actors = m.get("actors") if isinstance(m, Mapping) else None
        for actor in actors if isinstance(actors, list) else []:
            if not isinstance(actor, Mapping):
                continue
            rows.append(
                [
                    name,
                    str(actor.get("node", "?"))[:NODE_ID_SHOWN],
                    str(actor.get("ip") or "-"),
                    fmt_count(num(actor, "pid")),
                    str(actor.get("state", "?")),
                    fmt_count(num(actor, "decoded")),
                    fmt_count(num(actor, "lost")),
                ]
            )
    if not rows:
        return []
    return fmt_table(["actor of", "node", "ip", "pid", "state", "decoded", "lost"], rows)
