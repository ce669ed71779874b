"""`DecodeEngine`: the decoding engine built once (tokenizer, metrics, reader and decoders, pools) for feeds on it."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from omnifeed.loader import (
    DecodeConfig,
    FeedConfig,
    IndexConfig,
    PlanConfig,
    SampleIndex,
    TextDecodeConfig,
    build_index,
)
from omnifeed.loader.feed import DecodeEngine, Feed
from omnifeed.loader.plan import Plan

CONFIG = FeedConfig(plan=PlanConfig(seed=3, batch_size=4))


@pytest.fixture(scope="module")
def index(demo_shards: list[Path], tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    out = tmp_path_factory.mktemp("engine") / "index"
    build_index([str(p) for p in demo_shards], out, IndexConfig(workers=1), progress=False)
    return SampleIndex(out)


def threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("omnifeed-")}


def test_feeds_on_one_engine_deliver_what_a_feed_of_its_own_does_and_close_leaves_no_thread(index: SampleIndex) -> None:
    before = threads()
    engine = DecodeEngine.build(index, CONFIG)
    try:
        assert engine.config.decode.text.tokenizer == "regex"  # the index's, filled in once
        assert engine.pools is not None
        shared = engine.shared(Plan.from_index(index, engine.config.plan))
        with Feed(index, CONFIG, shared=shared) as feed, Feed(index, CONFIG) as own:
            for _ in range(3):
                mine, theirs = feed.next_batch(), own.next_batch()
                assert mine["__key__"] == theirs["__key__"]
                assert ("text" in mine) == ("text" in theirs)
                assert "text" not in mine or mine["text"]["tokens"].equal(theirs["text"]["tokens"])
            assert set(feed.metrics()) == set(own.metrics())
        assert engine.metrics.snapshot({})["batches"] == 3  # the feed counted into the engine's metrics
        assert engine.pools.owner(lambda exc: None) is not None  # the feed closed its share only
    finally:
        engine.close()
    assert threads() - before == set()


def test_a_user_decoder_replaces_the_built_in_of_its_modality_in_the_engine(index: SampleIndex) -> None:
    def shout(data: bytes, key: str) -> tuple[str, np.ndarray]:
        return "SHOUT", np.arange(3, dtype=np.int64)

    engine = DecodeEngine.build(index, CONFIG, decoders={"text": shout}, with_pools=False)
    try:
        assert engine.pools is None  # each pipeline makes its own
        with Feed(index, CONFIG, shared=engine.shared(Plan.from_index(index, CONFIG.plan))) as feed:
            batch = next(b for b in (feed.next_batch() for _ in range(12)) if "text" in b)
        assert set(batch["text"]["strings"]) == {"SHOUT"}
        assert batch["text"]["lengths"].tolist() == [3] * len(batch["text"]["strings"])
    finally:
        engine.close()


def test_a_tokenizer_other_than_the_index_s_is_refused_before_anything_starts(index: SampleIndex) -> None:
    before = threads()
    other = CONFIG.model_copy(update={"decode": DecodeConfig(text=TextDecodeConfig(tokenizer="bytes"))})
    with pytest.raises(ValueError, match="differs from the index's tokenizer"):
        DecodeEngine.build(index, other)
    assert threads() == before
