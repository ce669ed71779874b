"""Errors that say whose they are: a failing user decoder, transform or tokenizer costs one sample, reason 'user',
naming the function, the key, the field and the file, and never blames the dataset."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from labelled_data import index_of, write_labelled_tar

from omnifeed.loader import Feed, FeedConfig, FeedError, IndexConfig, PlanConfig, SampleIndex
from omnifeed.loader.decode import DecodeConfig, TextDecodeConfig

BAD_KEY = "sample-05"


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> SampleIndex:
    folder = tmp_path_factory.mktemp("user-errors")
    return index_of([write_labelled_tar(folder / "a.tar")], folder / "index")


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_code.py").write_text(
        "def fragile(value, key, epoch, rng):\n"
        f"    if key == {BAD_KEY!r}:\n"
        "        raise ValueError('no good')\n"
        "    return value\n"
        "def always(value, key, epoch, rng):\n"
        "    raise RuntimeError('broken on purpose')\n"
        "def tokens(text):\n"  # fails once the test says so: the index counts with it first
        f"    if text == 'caption 5' and __import__('os').path.exists({str(tmp_path / 'broken')!r}):\n"
        "        raise KeyError('unknown word')\n"
        "    return [1, 2]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_code", raising=False)  # this test's, not an earlier test's
    return "my_code"


def config(**extra: Any) -> FeedConfig:
    return FeedConfig(plan=PlanConfig(seed=1, batch_size=4), **extra)


def run_epoch(feed: Feed) -> list[dict]:
    return list(feed)


def the_replacement(batches: list[dict]) -> list[Any]:
    (replaced,) = [r for b in batches for r in b["__info__"]["replaced"]]
    return replaced


def assert_names_the_culprit(caplog: pytest.LogCaptureFixture, function: str, field: str, index: SampleIndex) -> None:
    (logged,) = [r.getMessage() for r in caplog.records if "replaced sample" in r.getMessage()]
    url = index.sample(0).shard.url
    for part in (
        repr(BAD_KEY),
        function,
        repr(field),
        url,
        repr(f"{BAD_KEY}.{field}"),
        "(image, user)" if field == "png" else "user",
    ):
        assert part in logged, (part, logged)
    assert "re-index" not in logged and "dataset looks broken" not in logged


def test_a_failing_user_decoder_costs_one_sample_and_is_named(
    index: SampleIndex, caplog: pytest.LogCaptureFixture
) -> None:
    def picky(data: bytes, key: str) -> np.ndarray:
        if key == BAD_KEY:
            raise ValueError("cannot handle this one")
        return np.zeros((3, 4, 4), np.uint8)

    with (
        caplog.at_level(logging.WARNING, logger="omnifeed.loader.feed._healing"),
        Feed(index, config(), decoders={"image": picky}) as feed,
    ):
        batches = run_epoch(feed)
        assert feed.metrics()["modalities"]["image"]["bad"] == {"user": 1}
    slot, key, reason = the_replacement(batches)
    assert (key, reason) == (BAD_KEY, "user")
    assert_names_the_culprit(
        caplog, f"{__name__}:test_a_failing_user_decoder_costs_one_sample_and_is_named.<locals>.picky", "png", index
    )


def test_a_failing_user_transform_costs_one_sample_and_is_named(
    index: SampleIndex, user_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    steps = {"image": [{"user": {"function": f"{user_module}:fragile"}}]}
    with (
        caplog.at_level(logging.WARNING, logger="omnifeed.loader.feed._healing"),
        Feed(index, config(transforms=steps)) as feed,
    ):
        assert the_replacement(run_epoch(feed))[1:] == [BAD_KEY, "user"]
    assert_names_the_culprit(caplog, "transform my_code:fragile raised ValueError: no good", "png", index)
    assert "my_code.py:3" in caplog.text, "the line that raised"


def test_a_failing_user_tokenizer_is_the_users_too(
    tmp_path: Path, user_module: str, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = f"{user_module}:tokens"
    index = index_of([write_labelled_tar(tmp_path / "a.tar")], tmp_path / "index", IndexConfig(tokenizer=tokenizer))
    (tmp_path / "broken").touch()
    decode = DecodeConfig(text=TextDecodeConfig(tokenizer=tokenizer))
    with (
        caplog.at_level(logging.WARNING, logger="omnifeed.loader.feed._healing"),
        Feed(index, config(decode=decode)) as feed,
    ):
        assert the_replacement(run_epoch(feed))[1:] == [BAD_KEY, "user"]
    assert_names_the_culprit(caplog, "tokenizer my_code:tokens raised KeyError", "txt", index)


def test_a_decoder_returning_what_a_batch_cannot_hold_is_a_user_error(index: SampleIndex) -> None:
    with Feed(index, config(), decoders={"cls": lambda data, key, field: object() if key == BAD_KEY else 1}) as feed:
        assert the_replacement(run_epoch(feed))[1:] == [BAD_KEY, "user"]


def test_a_function_that_always_fails_stops_the_feed_blaming_the_function_not_the_data(
    index: SampleIndex, user_module: str
) -> None:
    steps = {"image": [{"user": {"function": f"{user_module}:always"}}]}
    with Feed(index, config(transforms=steps)) as feed, pytest.raises(FeedError) as stopped:
        feed.next_batch()
    message = str(stopped.value)
    assert "my_code:always" in message and "a function of yours" in message
    assert "re-index" not in message and "dataset looks broken" not in message
