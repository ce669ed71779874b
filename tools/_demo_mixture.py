"""The demo's mixture step: the tar shards and a Parquet copy (filtered) blended in two phases, dealt through a resize.

Two sources of the same generated samples, written as other tools write them (WebDataset tars, one
Parquet file), each indexed; a mixture config (`mixture.yaml`, paths relative to it) weighs them
80/20 for the first half of the epoch and 30/70 after; the plan deals 2 ranks, saves its state,
resumes at 3 and finishes the mixture epoch; `verify_mixture` checks each source against the plan.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml

from omnifeed.loader import FeedConfig, IndexConfig, Plan, PlanCursor, build_index, delivery_records
from omnifeed.loader.plan import open_mixture, read_delivery_logs, verify_mixture

from ._demo_data import DemoDatasetSpec, write_parquet


def mixture_step(say: Callable[[str], None], out: Path, spec: DemoDatasetSpec, tar_index: Path) -> bool:
    """Run the step in ``out`` (beside the demo's tar index ``tar_index``); True when every source verified."""
    table = build_index(
        [str(write_parquet(out / "data-parquet" / "demo.parquet", spec))],
        out / "index-parquet",
        IndexConfig(partitions=2),
        progress=False,
    )
    half = spec.num_samples
    config_path = out / "mixture.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "plan": {
                    "seed": 0,
                    "batch_size": 4,
                    "mixture": {
                        "sources": {
                            "tars": {"index": tar_index.name, "weight": 0.5},
                            "table": {"index": table.path.name, "weight": 0.5, "where": {"text_tokens": [1, 40]}},
                        },
                        "phases": [
                            {"until_samples": half, "weights": {"tars": 0.8, "table": 0.2}},
                            {"weights": {"tars": 0.3, "table": 0.7}},
                        ],
                    },
                }
            },
            sort_keys=False,
        ),
        encoding="utf-8",
    )
    config = FeedConfig.from_yaml(config_path).plan
    assert config.mixture is not None
    index = open_mixture(config.mixture)
    plan = Plan.from_index(index, config)
    say(
        f"{config_path.name}: tars {index.sizes[0]} samples, table {index.sizes[1]} kept "
        f"({index.removed['table']} removed by its filter, text_tokens in [1, 40]); a mixture epoch of "
        f"{plan.num_samples} samples: 80/20 for the first {half}, 30/70 after"
    )
    log_path = out / "mixture-delivery.jsonl"
    state = None
    with log_path.open("w", encoding="utf-8") as log:
        for world_size, steps in ((2, 10), (3, None)):
            cursor = PlanCursor(plan, world_size=world_size)
            if state is not None:
                cursor.load_state_dict(state)
            dealt = 0
            while (dealt < steps) if steps is not None else not cursor.epoch_delivered(0):
                for record in delivery_records(cursor.next_step(), index):
                    log.write(json.dumps(record) + "\n")
                dealt += 1
            state = cursor.state_dict()
            say(f"world size {world_size}: {dealt} steps; state {len(json.dumps(state))} bytes")
    report = verify_mixture(index, plan, 0, read_delivery_logs([log_path]))
    for name, source in report.sources.items():
        say(
            f"  {name:<6} planned {source.planned:>4}, delivered {source.delivered:>4}, duplicates "
            f"{source.duplicates}, missing {source.missing}, share {source.share:.3f}, source epochs "
            f"{source.source_epochs[0]}..{source.source_epochs[1]}"
        )
    say(
        "OK: each source's samples of mixture epoch 0 delivered as its schedule planned, across 2 -> 3 ranks."
        if report.ok
        else "FAILED: the mixture was not delivered as planned."
    )
    return report.ok
