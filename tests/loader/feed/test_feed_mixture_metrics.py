"""Per-source metrics of a mixture feed: the samples delivered, their text tokens and the samples replaced, by
source."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from omnifeed.loader import DecodeConfig, DecodeError, Feed, FeedConfig, IndexConfig, build_index, make_decoder

MIXTURE = {
    "sources": {
        "tars": {"index": "tar-index", "weight": 0.7},
        "table": {"index": "parquet-index", "weight": 0.3},
    }
}


@pytest.fixture(scope="module")
def config(index_dir: Path, demo_parquet: Path, tmp_path_factory: pytest.TempPathFactory) -> FeedConfig:
    """A two-source mixture of the demo data (its tar shards, its Parquet file), read from YAML."""
    out = tmp_path_factory.mktemp("mixture-metrics")
    (out / "tar-index").symlink_to(index_dir)
    build_index([str(demo_parquet)], out / "parquet-index", IndexConfig(workers=1), progress=False)
    path = out / "feed.yaml"
    path.write_text(yaml.safe_dump({"plan": {"seed": 4, "batch_size": 4, "mixture": MIXTURE}}))
    return FeedConfig.from_yaml(path).model_copy(update={"error_budget": 0.5})


def by_source(index: Any, keys: list[str]) -> tuple[Counter[str], Counter[str]]:
    """Samples and text tokens (the index's) of ``keys`` per source."""
    tokens = index.length_columns(index.positions_of(keys))["text_tokens"]
    samples, counted = Counter[str](), Counter[str]()
    for key, n in zip(keys, np.asarray(tokens).tolist()):
        samples[key.split("/")[0]] += 1
        counted[key.split("/")[0]] += int(n)
    return samples, counted


def test_a_mixture_feed_counts_each_sources_delivered_samples_and_their_text_tokens(config: FeedConfig) -> None:
    with Feed(None, config) as feed:
        assert feed.metrics()["sources"] == {
            name: {"samples": 0, "tokens": 0, "replaced": 0, "samples_per_s": 0.0, "tokens_per_s": 0.0}
            for name in ("tars", "table")
        }
        keys = [key for _ in range(len(feed)) for key in feed.next_batch()["__key__"]]
        sources = feed.metrics()["sources"]
        samples, tokens = by_source(feed.index, keys)
    assert set(samples) == {"tars", "table"} and all(tokens.values())
    assert {name: s["samples"] for name, s in sources.items()} == samples
    assert {name: s["tokens"] for name, s in sources.items()} == tokens
    assert all(s["replaced"] == 0 and s["samples_per_s"] > 0 for s in sources.values())


def test_samples_replaced_by_healing_are_counted_for_the_source_they_were_planned_from(config: FeedConfig) -> None:
    image = make_decoder("image", DecodeConfig())

    def bad(key: str) -> bool:  # every third image of the table
        return key.startswith("table/") and int(key[-6:]) % 3 == 0

    def flaky(data: bytes, key: str) -> Any:
        if bad(key):
            raise DecodeError(f"{key}: damaged")
        return image(data, key)

    with Feed(None, config, decoders={"image": flaky}) as feed:
        batches = [feed.next_batch() for _ in range(len(feed))]
        sources = feed.metrics()["sources"]
        samples, tokens = by_source(feed.index, [key for batch in batches for key in batch["__key__"]])
    replaced = Counter(key.split("/")[0] for batch in batches for _, key, _ in batch["__info__"]["replaced"])
    assert replaced["table"] > 0 and all(bad(key) for batch in batches for _, key, _ in batch["__info__"]["replaced"])
    assert {name: s["replaced"] for name, s in sources.items()} == {"tars": 0, "table": replaced["table"]}
    assert {name: s["samples"] for name, s in sources.items()} == samples  # the stand-ins, by their own source
    assert {name: s["tokens"] for name, s in sources.items()} == tokens


def test_a_single_index_feed_has_no_per_source_metrics(index_dir: Path) -> None:
    with Feed(index_dir, FeedConfig()) as feed:
        feed.next_batch()
        assert "sources" not in feed.metrics()
