"""The batch ledger: micro-batches handed over from retired streams (taken once, bounded, checked by key) and
batches lent to clients after their stream dropped them (recycled when the last holder lets go)."""

from __future__ import annotations

import os
import threading
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import pytest

from omnifeed.loader import PlanConfig
from omnifeed.loader.index import SampleIndex
from omnifeed.loader.plan import MicroBatch, Plan, PlanCursor
from omnifeed.loader.service._arena import HeldCount
from omnifeed.loader.service._ledger import BatchLedger
from omnifeed.loader.service._producer_process import _HandoverAsked
from omnifeed.loader.service._stream import Ready


@pytest.fixture(scope="module")
def index(index_dir: Path) -> SampleIndex:
    return SampleIndex(index_dir)


def micro_batches(index: SampleIndex, count: int) -> list[MicroBatch]:
    cursor = PlanCursor(Plan.from_index(index, PlanConfig(seed=3, batch_size=4)), world_size=1)
    return [cursor.next_step().for_rank(0)[0] for _ in range(count)]


def harvested(index: SampleIndex, micro_batch: MicroBatch, tag: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What a retired stream hands over: the micro-batch's delivery record and its decoded samples."""
    record = {"epoch": micro_batch.epoch, "micro_batch": micro_batch.index, "keys": index.keys(micro_batch.positions)}
    return record, [{"meta": {"tag": tag}}]


def test_a_handed_over_micro_batch_is_taken_once_and_counted(index: SampleIndex) -> None:
    ledger = BatchLedger(index)
    first, second = micro_batches(index, 2)
    ledger.hand_over([harvested(index, first, "first")])
    assert ledger.take(second) is None
    assert ledger.take(first) == [{"meta": {"tag": "first"}}]
    assert ledger.take(first) is None
    assert ledger.handed_over == 1


def test_an_entry_whose_keys_differ_is_not_handed_over(index: SampleIndex) -> None:
    ledger = BatchLedger(index)
    (micro_batch,) = micro_batches(index, 1)
    record, samples = harvested(index, micro_batch, "other plan")
    ledger.hand_over([({**record, "keys": list(reversed(record["keys"]))}, samples)])
    assert ledger.take(micro_batch) is None and ledger.handed_over == 0


def test_the_oldest_entries_go_beyond_the_limit_and_a_new_change_clears_them(index: SampleIndex) -> None:
    ledger = BatchLedger(index, limit=2)
    batches = micro_batches(index, 4)
    ledger.hand_over([harvested(index, b, str(i)) for i, b in enumerate(batches[:3])])
    assert ledger.take(batches[0]) is None  # dropped: over the limit
    assert ledger.take(batches[1]) == [{"meta": {"tag": "1"}}]
    ledger.clear_handover()
    assert ledger.take(batches[2]) is None


class FakeStream:
    """The part of a stream the ledger uses: `return_lent`, recycling a batch its last holder dropped."""

    def __init__(self) -> None:
        self.recycled: list[Ready] = []

    def return_lent(self, ready: Ready, token: str, left: bool) -> bool:
        if token not in ready.holders:
            return False
        ready.holders.discard(token)
        ready.abandoned = ready.abandoned or left
        if ready.holders:
            return False
        self.recycled.append(ready)
        return True


def lent_batch(seq: int, *holders: str) -> Ready:
    return Ready(seq, {}, {}, None, b"", {}, holders=set(holders))  # type: ignore[arg-type]


def test_a_lent_batch_is_recycled_when_its_last_holder_releases_it(index: SampleIndex) -> None:
    ledger, stream = BatchLedger(index), FakeStream()
    shared, mine = lent_batch(1, "a", "b"), lent_batch(2, "a")
    ledger.lend(shared, stream)  # type: ignore[arg-type]
    ledger.lend(mine, stream)  # type: ignore[arg-type]
    ledger.release("a", {1, 2})
    assert stream.recycled == [mine] and shared.holders == {"b"} and ledger.lent() == 1
    ledger.release("b", {99})  # not a batch it holds
    assert ledger.lent() == 1
    ledger.release("b", None)  # the client left holding it
    assert stream.recycled == [mine, shared] and shared.abandoned and not mine.abandoned
    assert ledger.lent() == 0


def test_the_held_count_producer_processes_read_follows_the_hand_over_entries(index: SampleIndex) -> None:
    ledger = BatchLedger(index)
    seen = HeldCount(fd=os.dup(ledger.held.fd))  # mapped again, read-only, as a producer process maps it
    try:
        first, second, third = micro_batches(index, 3)
        assert seen.get() == 0
        ledger.hand_over([harvested(index, first, "a"), harvested(index, second, "b")])
        assert seen.get() == 2
        ledger.take(first)
        assert seen.get() == 1
        ledger.take(third)  # not held: the count stays
        assert seen.get() == 1
        ledger.clear_handover()
        assert seen.get() == 0
    finally:
        seen.close()
        ledger.close()


def test_a_producer_process_asks_for_hand_overs_only_while_the_service_holds_some(index: SampleIndex) -> None:
    ledger = BatchLedger(index)
    service_end, producer_end = Pipe(duplex=True)
    asked = _HandoverAsked(producer_end, HeldCount(fd=os.dup(ledger.held.fd)))
    first, second = micro_batches(index, 2)
    try:
        assert asked(first) is None and not service_end.poll()  # nothing held: no question on the pipe
        ledger.hand_over([harvested(index, second, "b")])
        answer = threading.Thread(target=lambda: service_end.send(ledger.take_at(*service_end.recv())), daemon=True)
        answer.start()
        assert asked(second) == [{"meta": {"tag": "b"}}]
        answer.join(timeout=10)
        assert asked(first) is None and not service_end.poll()  # the count is back to zero
    finally:
        service_end.close()
        producer_end.close()
        ledger.close()
