"""A stream alone, over the demo index: its rank's batches in plan order in shared memory, peers, restarts, release.

The stream gets a `StreamContext` built here from real engine parts (never a service), with each of
the two producers (its feed in this process, or in a producer process); what it reports through the
context (batch numbers, audit records, lent batches) is recorded.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnifeed.loader import MODALITIES, Feed, FeedConfig, PlanConfig, verify_coverage
from omnifeed.loader.feed import DecodeEngine, FeedPosition
from omnifeed.loader.index import SampleIndex
from omnifeed.loader.plan import Plan
from omnifeed.loader.service._ledger import BatchLedger
from omnifeed.loader.service._producer import ChildProducer, FeedProducer, Producer, ProducerSpec
from omnifeed.loader.service._protocol import RequestError, decode
from omnifeed.loader.service._stream import Ready, Stream, StreamContext
from omnifeed.loader.service._streams import Resizes, StreamTable

CONFIG = FeedConfig(plan=PlanConfig(seed=3, batch_size=4))  # the demo index: 48 samples, 12 micro-batches an epoch


class Recorded:
    """What streams told their context."""

    def __init__(self, index: SampleIndex, plan: Plan) -> None:
        self.index, self.plan = index, plan
        self.audited: list[dict[str, Any]] = []
        self.lent: list[Ready] = []


@pytest.fixture(params=["threads", "processes"])
def parts(index_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[StreamContext, Recorded]]:
    index = SampleIndex(index_dir)
    plan = Plan.from_index(index, CONFIG.plan)
    engine = DecodeEngine.build(index, CONFIG)
    seen = Recorded(index, plan)
    if request.param == "threads":
        shared = engine.shared(plan)

        def producer(key: tuple[int, int, int], start: FeedPosition) -> Producer:
            return FeedProducer(index, engine.config, shared, key, start)
    else:
        spec = engine.config.model_dump_json()
        handover = BatchLedger(index)  # as the service builds them

        def producer(key: tuple[int, int, int], start: FeedPosition) -> Producer:
            return ChildProducer(ProducerSpec(str(index_dir), spec, key), handover=handover).start_at(start)

    context = StreamContext(
        producer,
        prefetch_batches=2,
        next_seq=itertools.count().__next__,
        record_resize=lambda started: None,
        audit=seen.audited.append,
        lend=lambda ready, stream: seen.lent.append(ready),
    )
    yield context, seen
    engine.close()


def start(parts: tuple[StreamContext, Recorded], key: tuple[int, int, int] = (1, 0, 1), group: int = 1) -> Stream:
    context, seen = parts
    return Stream(context, key, group, FeedPosition.start(seen.plan, world_size=key[0], grad_accum=key[2]))


def take(stream: Stream, client: int) -> Ready:
    return stream.take(client, threading.Event())


def attach(stream: Stream, client: int, state: FeedPosition | None = None, group: int = 1) -> None:
    stream.attach(client, f"token-{client}", client, state or stream.head, since="a1", group=group)


def test_a_stream_delivers_its_ranks_micro_batches_in_plan_order_in_shared_memory(parts, index_dir: Path) -> None:
    context, seen = parts
    stream = start(parts, key=(2, 1, 1))
    try:
        attach(stream, 7)
        taken = [take(stream, 7) for _ in range(3)]
    finally:
        stream.close()
    with Feed(index_dir, CONFIG, world_size=2, rank=1) as feed:
        expected = [feed.take().keys for _ in range(3)]
    assert [r.record["keys"] for r in taken] == expected
    assert [r.after for r in taken[:-1]] == [r.before for r in taken[1:]]  # each starts where the last ended
    assert len({r.seq for r in taken}) == 3 and all(r.segment.slot >= 0 for r in taken)
    assert decode(taken[0].frame[4:], lambda code, data: data)["seq"] == taken[0].seq
    assert [a["keys"] for a in seen.audited] == expected and {a["since"] for a in seen.audited} == {"a1"}


def test_peers_of_a_group_get_the_same_batch_audited_once(parts) -> None:
    context, seen = parts
    stream = start(parts, group=2)
    try:
        attach(stream, 1, group=2)
        attach(stream, 2, group=2)
        first, second = take(stream, 1), take(stream, 2)
    finally:
        stream.close()
    assert first is second and first.takers == {1, 2} and first.holders == {"token-1", "token-2"}
    assert len(seen.audited) == 1


def test_a_batch_given_back_by_every_peer_that_took_it_is_logged_returned_and_again_when_taken_later(
    parts, index_dir: Path
) -> None:
    context, seen = parts
    stream = start(parts, group=3)
    try:
        for client in (1, 2, 3):
            attach(stream, client, group=3)
        first = take(stream, 1)
        take(stream, 2)
        stream.give_back(1, {first.seq})  # peer 2's trainer has it: the delivery stands
        assert len(seen.audited) == 1
        stream.give_back(2, {first.seq})  # every taker gave it back: no trainer had it
        assert seen.audited[-1] == {
            "returned": "a1",
            **{f: first.record[f] for f in ("epoch", "step", "rank", "accum", "micro_batch", "topology_version")},
            "keys": [],
        }
        take(stream, 3)  # a peer that had not taken it yet does: delivered after all
        stream.give_back(3, {first.seq + 1000})  # numbers it never took change nothing
    finally:
        stream.close()
    assert [("returned" in r, r["micro_batch"]) for r in seen.audited] == [(False, 0), (True, 0), (False, 0)]
    report = verify_coverage(SampleIndex(index_dir), 0, seen.audited)  # what `omnifeed verify` counts
    assert (report.delivered, report.duplicates) == (len(first.record["keys"]), 0)


def test_a_batch_a_crashed_client_still_holds_is_logged_again_for_the_attempt_that_takes_it(parts) -> None:
    context, seen = parts
    stream = start(parts)
    try:
        start_position = stream.head
        attach(stream, 1)  # attempt a1: takes two batches, holds them, and is killed (its end not yet seen)
        crashed = [take(stream, 1), take(stream, 1)]
        stream.attach(2, "token-2", 0, start_position, since="a2")  # the restart, from the same checkpoint
        again = [take(stream, 2), take(stream, 2)]
    finally:
        stream.close()
    assert again == crashed  # the batches still held are served again, not produced anew
    assert [(r["micro_batch"], r["since"]) for r in seen.audited] == [(0, "a1"), (1, "a1"), (0, "a2"), (1, "a2")]


def test_a_client_at_an_earlier_position_restarts_production_there_and_held_batches_are_lent(parts) -> None:
    context, seen = parts
    stream = start(parts)
    try:
        attach(stream, 1)
        origin = stream.head
        first, held = take(stream, 1), take(stream, 1)
        stream.release("token-1", {first.seq})  # dropped: the stream no longer has the batch at ``origin``
        attach(stream, 2, state=origin)  # a client from an earlier checkpoint
        again = take(stream, 2)
        with stream._cond:  # the producer's state, observed
            stream._cond.wait_for(lambda: stream.restart_to is None, timeout=60)
    finally:
        stream.close()
    assert again.record["keys"] == first.record["keys"] and again.seq != first.seq  # produced again
    assert [id(r) for r in seen.lent] == [id(held)]  # dropped by the restart while client 1 holds it: lent


def test_a_lent_batch_returned_by_its_last_holder_who_left_gives_up_its_segment(parts) -> None:
    context, seen = parts
    stream = start(parts)
    try:
        attach(stream, 1)
        origin = stream.head
        stream.release("token-1", {take(stream, 1).seq})
        held = take(stream, 1)
        attach(stream, 2, state=origin)  # a restart drops ``held`` while client 1 holds it: lent
        take(stream, 2)
        assert [id(r) for r in seen.lent] == [id(held)]
        slot = (held.segment.slot, held.segment.generation)
        assert not stream.return_lent(held, "token-2", left=False)  # not a holder of it
        assert slot in stream.live() and not held.abandoned
        assert stream.return_lent(held, "token-1", left=True)  # its holder left holding it: never reused
        assert held.abandoned and not held.holders and slot not in stream.live()
    finally:
        stream.close()


def test_a_released_batch_is_dropped_and_its_segment_reused(parts) -> None:
    context, _ = parts
    stream = start(parts)
    try:
        attach(stream, 1)
        first = take(stream, 1)
        take(stream, 1)  # the client is past the first batch, but holds it
        assert first in stream.ready
        stream.release("token-1", {first.seq})
        assert first not in stream.ready
        for _ in range(8):
            stream.release("token-1", {take(stream, 1).seq})
        count, _ = stream.segments()
    finally:
        stream.close()
    assert count <= 2 + 2 * 1 + 2  # prefetch + 2 × group + 2 slots at most
    assert stream.one_offs == 0


def test_untaken_batches_are_harvested_as_decoded_samples(parts) -> None:
    stream = start(parts)
    try:
        with stream._cond:  # the producer's state, observed; harvest takes the lock again (a Condition's RLock)
            stream._cond.wait_for(lambda: len(stream.ready) >= 2 or stream.error is not None, timeout=60)
            assert stream.error is None
            harvested = stream.harvest()
    finally:
        stream.close()
    assert len(harvested) >= 2
    record, samples = harvested[0]
    assert len(samples) == len(record["keys"]) and all(set(sample) & set(MODALITIES) for sample in samples)


def test_close_stops_the_producer_frees_every_segment_and_refuses_takers(parts) -> None:
    context, _ = parts
    stream = start(parts)
    attach(stream, 1)
    take(stream, 1)
    stream.close()
    stream.close()  # idempotent
    assert stream.segments() == (0, 0) and not stream.ready
    assert not stream._thread.is_alive()  # the producer
    with pytest.raises(RequestError) as refused:
        take(stream, 1)
    assert refused.value.code == "closing"


def test_an_idle_sweep_never_closes_a_stream_between_its_opening_and_its_first_client(parts) -> None:
    context, seen = parts
    table = StreamTable(context, BatchLedger(seen.index), Resizes(), max_clients=8, max_dealt=1 << 20)
    swept = threading.Event()
    start_at = FeedPosition.start(seen.plan, world_size=1, grad_accum=1)

    def attach(stream: Stream) -> None:  # a sweep of idle streams (`stream_idle_s: 0`) at the worst moment
        threading.Thread(target=lambda: (table.close_idle(0), swept.set())).start()
        swept.wait(0.2)
        stream.attach(1, "token-1", 0, start_at, since="a1")

    try:
        stream = table.open((1, 0, 1), 1, start_at, attach)
        swept.wait()
        assert not stream.closed  # its client is attached: the sweep found it busy
        assert take(stream, 1).before == start_at
    finally:
        table.close()
