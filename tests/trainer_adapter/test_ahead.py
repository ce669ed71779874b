"""`BatchesAhead`: a client's next batches received on a thread of their own, ahead of the trainer."""

from __future__ import annotations

import gc
import threading

import pytest

from omnifeed.trainer_adapter._ahead import BatchesAhead


class Counter:
    """A fetch that counts, and fails once on the call numbered ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls = 0
        self.fail_at = fail_at
        self.gate = threading.Event()
        self.gate.set()
        self.called = threading.Event()

    def fetch(self) -> int:
        self.called.set()
        self.gate.wait()
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("the service went away")
        return self.calls


def settle(ahead: BatchesAhead[int], count: int) -> None:
    """Wait until ``count`` batches are received ahead (the thread's own progress, not a time)."""
    while ahead._items.qsize() < count:
        threading.Event().wait(0.005)


def test_batches_come_in_order_with_at_most_depth_received_ahead() -> None:
    source = Counter()
    ahead = BatchesAhead(source.fetch, 2, "test-ahead")
    assert source.calls == 0  # nothing before the first take
    assert [ahead.take() for _ in range(5)] == [1, 2, 3, 4, 5]
    settle(ahead, 2)
    assert source.calls == 7  # five taken, two waiting: no more
    ahead.stop()


def test_an_error_is_raised_by_the_take_that_reaches_it_and_fetching_starts_again() -> None:
    source = Counter(fail_at=2)
    ahead = BatchesAhead(source.fetch, 3, "test-ahead")
    assert ahead.take() == 1
    settle(ahead, 1)
    threading.Event().wait(0.2)
    assert source.calls == 2  # nothing fetched after the error until it was taken
    with pytest.raises(ConnectionError, match="went away"):
        ahead.take()
    assert [ahead.take(), ahead.take()] == [3, 4]
    ahead.stop()


def test_paused_holds_the_thread_and_drain_gives_back_what_was_received() -> None:
    source = Counter()
    ahead = BatchesAhead(source.fetch, 2, "test-ahead")
    assert ahead.take() == 1
    settle(ahead, 2)
    with ahead.paused():
        assert ahead.drain() == [2, 3]
        calls = source.calls
        threading.Event().wait(0.2)
        assert source.calls == calls  # the owner may use the connection: nothing is fetched meanwhile
    assert ahead.take() == 4
    ahead.stop()


def test_paused_waits_for_a_fetch_in_flight() -> None:
    source = Counter()
    ahead = BatchesAhead(source.fetch, 1, "test-ahead")
    assert ahead.take() == 1
    settle(ahead, 1)
    source.gate.clear()
    source.called.clear()
    assert ahead.take() == 2
    source.called.wait()  # the thread is fetching the third, held at the gate
    entered = threading.Event()

    def pause() -> None:
        with ahead.paused():
            entered.set()

    pauser = threading.Thread(target=pause)
    pauser.start()
    assert not entered.wait(0.2)  # the fetch in flight is not interrupted
    source.gate.set()
    pauser.join()
    assert entered.is_set() and ahead.take() == 3
    ahead.stop()


def test_the_thread_ends_when_its_owner_is_dropped() -> None:
    source = Counter()
    ahead = BatchesAhead(source.fetch, 1, "test-ahead")
    ahead.take()
    settle(ahead, 1)
    thread = ahead._thread
    assert thread is not None and thread.is_alive()
    del source
    gc.collect()
    ahead.take()  # the batch already received; then the thread finds its owner gone
    thread.join(60)
    assert not thread.is_alive()


def test_take_after_stop_says_the_client_is_closed() -> None:
    ahead = BatchesAhead(Counter().fetch, 1, "test-ahead")
    ahead.stop()
    with pytest.raises(RuntimeError, match="closed"):
        ahead.take()
