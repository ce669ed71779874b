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


def test_where_a_modality_decodes_is_one_executor_choice_with_the_same_bytes(
    index: SampleIndex, tmp_path: Path
) -> None:
    (tmp_path / "feed.yaml").write_text(
        "plan: {seed: 3, batch_size: 4}\n"
        "shared_workers: 0\n"
        "pools:\n"
        "  image: {executor: processes, workers: 1}\n"
        "  video: {executor: threads, workers: 1}\n"
        "  audio: {workers: 1}\n"
        "  text: {workers: 1}\n"
    )
    config = FeedConfig.from_yaml(tmp_path / "feed.yaml")
    assert [config.pool(m).executor for m in ("image", "video", "audio")] == ["processes", "threads", "threads"]
    engine = DecodeEngine.build(index, config)
    try:
        names = sorted(t.name for t in threads() if t.name.startswith(("omnifeed-image", "omnifeed-video")))
        assert names == ["omnifeed-image-0", "omnifeed-image-1", "omnifeed-video-0"]  # two hand tasks to one process
        assert set(engine.reader.decoders._executors) == {"image"}  # noqa: SLF001  only image decodes in processes
        with Feed(index, config, shared=engine.shared(Plan.from_index(index, engine.config.plan))) as feed:
            got = [feed.next_batch() for _ in range(3)]
    finally:
        engine.close()
    with Feed(index, CONFIG) as feed:
        expected = [feed.next_batch() for _ in range(3)]
    assert any("image" in a for a in got)  # the processes decoded some
    for a, b in zip(got, expected):
        assert a["__key__"] == b["__key__"]
        for modality in ("image", "video", "audio"):
            assert (modality in a) == (modality in b)
            if modality in a:
                x, y = a[modality], b[modality]
                assert all(u.equal(v) for u, v in zip(x.values(), y.values())) if isinstance(x, dict) else x.equal(y)


@pytest.mark.parametrize(
    ("pool", "says"),
    [
        ("{executor: threads, processes: 2}", "set executor: processes"),
        ("{executor: processes, remote: {workers: 1}}", "set executor: ray"),
        ("{executor: processes, workers: 0}", "needs workers: 1 or more"),
    ],
)
def test_fields_of_another_executor_are_refused_in_one_line_that_names_the_choice(
    tmp_path: Path, pool: str, says: str
) -> None:
    (tmp_path / "feed.yaml").write_text(f"pools:\n  image: {pool}\n")
    with pytest.raises(ValueError, match=says) as refused:
        FeedConfig.from_yaml(tmp_path / "feed.yaml")
    assert "pools.image" in str(refused.value) and len(str(refused.value).splitlines()) == 1


def test_the_spellings_before_the_executor_choose_it() -> None:
    from omnifeed.loader import PoolConfig

    assert PoolConfig(workers=4, processes=2).executor == "processes"
    assert (PoolConfig(workers=4, processes=2).threads, PoolConfig(workers=4, processes=2).decode_processes) == (4, 2)
    assert PoolConfig(remote={"workers": 1}).executor == "ray"
    assert PoolConfig(executor="ray", workers=0).remote is not None  # Ray only: the default actors
