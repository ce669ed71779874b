"""Self-healing: which batch-mate replaces a failed sample, and the error budget that stops a broken dataset."""

from __future__ import annotations

import logging
import pickle

import pytest

from omnifeed.loader import OmnifeedError
from omnifeed.loader.feed import FeedError
from omnifeed.loader.feed._healing import ErrorBudget, SampleFailure, fallback_positions, replacement_slot


def failure(n: int, url: str = "s3://bucket/shard-0000.tar", reason: str = "corrupt") -> SampleFailure:
    return SampleFailure(
        key=f"k{n}",
        url=url,
        modality="image",
        reason=reason,
        message="cannot identify image file",
        field="jpg",
        member=f"k{n}.jpg",
    )


@pytest.mark.parametrize(
    "healthy,slot,expected",
    [
        ([True, False, True, True], 1, 2),  # the next healthy slot
        ([True, True, False, False], 2, 0),  # wraps around past the end
        ([False, True, False, False], 3, 1),
        ([False, False, False], 0, None),  # nothing healthy: the feed falls back to a stand-in from the index
    ],
)
def test_a_failed_slot_takes_the_next_healthy_batch_mate(healthy: list[bool], slot: int, expected: int | None) -> None:
    assert replacement_slot(slot, healthy) == expected


def test_stand_in_candidates_are_the_same_on_every_replay_and_never_the_failed_sample() -> None:
    for position, num_samples in [(0, 10), (7, 10), (123_456, 10_000_000), (0, 2)]:
        first = list(fallback_positions(position, num_samples))
        assert first == list(fallback_positions(position, num_samples))
        assert first and position not in first and all(0 <= p < num_samples for p in first)
    assert list(fallback_positions(0, 1)) == [], "a one-sample index has no stand-in"


def test_the_budget_is_not_enforced_before_its_minimum_sample_count() -> None:
    budget = ErrorBudget(budget=0.01, min_samples=100)
    budget.record(50, [failure(i) for i in range(50)])  # every sample so far failed, but only 50 read
    assert (budget.read, budget.failed) == (50, 50)
    with pytest.raises(FeedError, match="100 of 100 samples"):
        budget.record(50, [failure(50 + i) for i in range(50)])


def test_failures_up_to_the_budget_fraction_pass_and_one_more_stops_the_feed() -> None:
    budget = ErrorBudget(budget=0.25, min_samples=10)
    budget.record(100, [failure(i) for i in range(25)])  # 25 % exactly: within the budget
    budget.record(20, [failure(25 + i) for i in range(5)])  # 30 of 120 = 25 %: still within
    with pytest.raises(FeedError) as stopped:
        budget.record(1, [failure(30)])  # 31 of 121 > 25 %
    assert "31 of 121 samples could not be read or decoded (25.6%, over the error budget of 25.0%)" in str(
        stopped.value
    )
    assert "FeedConfig.error_budget" in str(stopped.value)


def test_a_zero_budget_stops_at_the_first_failure_once_enough_samples_were_read() -> None:
    budget = ErrorBudget(budget=0.0, min_samples=1)
    budget.record(1000, [])
    with pytest.raises(FeedError, match="1 of 1001"):
        budget.record(1, [failure(0)])


def test_the_error_names_the_files_with_the_most_failures_worst_first() -> None:
    budget = ErrorBudget(budget=0.0, min_samples=10_000)
    counts = {"a.tar": 1, "b.tar": 7, "c.tar": 3, "d.tar": 5, "e.tar": 2, "f.tar": 4}
    budget.record(100, [failure(i, url) for url, n in counts.items() for i in range(n)])
    with pytest.raises(FeedError) as stopped:
        budget.record(10_000, [])
    message = str(stopped.value)
    assert "b.tar (7), d.tar (5), f.tar (4), c.tar (3), e.tar (2)" in message
    assert "a.tar" not in message, "the five worst files only"


def test_each_failed_sample_is_logged_once_however_often_it_fails(caplog: pytest.LogCaptureFixture) -> None:
    budget = ErrorBudget(budget=1.0, min_samples=1)
    with caplog.at_level(logging.WARNING, logger="omnifeed.loader.feed._healing"):
        for _ in range(3):  # the same bad sample, in three epochs
            budget.record(4, [failure(1)])
    assert budget.failed == 3
    (logged,) = [r.getMessage() for r in caplog.records]
    for part in ("'k1'", "'jpg'", "s3://bucket/shard-0000.tar", "'k1.jpg'", "corrupt", "cannot identify image file"):
        assert part in logged


def test_failures_in_the_users_own_functions_are_not_blamed_on_the_files() -> None:
    budget = ErrorBudget(budget=0.0, min_samples=1)
    with pytest.raises(FeedError) as stopped:
        budget.record(10, [failure(0, reason="user"), failure(1, reason="user")])
    assert "2 failed in a function of yours" in str(stopped.value)
    assert "files with the most failures" not in str(stopped.value)


def test_feed_error_is_an_omnifeed_error_that_survives_a_process_boundary() -> None:
    error = pickle.loads(pickle.dumps(FeedError("3 of 10 samples could not be read")))
    assert isinstance(error, OmnifeedError) and str(error) == "3 of 10 samples could not be read"
