"""A stream's producer process: its `Feed`, answering the stream's requests (`_producer`, `ChildProducer`).

Three pipes to the stream: the **work** pipe (one request at a time: a batch into a segment, or
a seek; the protocol is in `_producer`'s docstring), the **metrics** pipe, answered by a thread
of its own so the service's metrics are the feed's of the moment, even while a batch is being
made, and the **hand-over** pipe, on which the feed's pipeline asks the service, before decoding
a micro-batch, whether a retired stream had it decoded already (after a resize; answered by a
thread of the service's). The work pipe's end is how the process learns that the service stopped or died: it
finishes the batch in hand, closes its feed and exits.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import numpy as np

from ..feed import DecodeEngine, Feed, FeedConfig, FeedPosition, Taken, collate, open_feed_index
from ..plan import MicroBatch, Plan
from ._arena import HeldCount, Segment, SegmentWriter, encode_batch
from ._protocol import encode

_ASKED = 256  # micro-batches after a start or seek for which the service is asked for a hand-over
Key = tuple[int, int, int]  # (data-parallel size, data-parallel rank, accumulation)
Grow = Callable[[Segment, int], Segment]
"""The segment that replaces one a batch of so many bytes overflowed (the old one is closed)."""


@dataclass(frozen=True)
class ProducerSpec:
    """What a producer process builds its feed from: the index (absolute; None: ``config.plan.mixture``), the feed
    config as JSON (the service engine's: the index's tokenizer filled in), the stream's key."""

    index: str | None
    config_json: str
    key: Key


class ProducerGone(Exception):
    """The other end of a producer's pipe is gone: the process died, or the service stopped or died."""


def batch_frame(taken: Taken, after: FeedPosition, seq: int, segment: Segment, grow: Grow) -> tuple[bytes, Segment]:
    """``taken`` collated into ``segment`` (into a grown one when it does not fit), and the frame that sends it."""
    writer = SegmentWriter(segment)
    batch = collate(taken.samples, taken.keys, taken.info, writer.alloc)
    if writer.overflowed:
        del batch
        segment = grow(segment, writer.needed)
        writer = SegmentWriter(segment)
        batch = collate(taken.samples, taken.keys, taken.info, writer.alloc)
    layout, rest = encode_batch(batch, segment)
    message = {
        "op": "batch",
        "seq": seq,
        "segment": segment.name,
        "layout": layout,
        "batch": rest,
        "state": after.to_dict(),
    }
    return encode(message), segment


def serve(
    work: Connection,
    metrics: Connection,
    handover: Connection,
    spec: ProducerSpec,
    start: dict[str, Any],
    handover_from_service: bool = False,
) -> None:
    """A producer process: build the stream's feed at ``start``, then answer the stream's requests until its work
    pipe ends. ``handover_from_service``: the hand-over pipe first brings the descriptor of the service's
    `HeldCount`, and the feed asks there for micro-batches decoded already (else it never asks)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service decides when its producers stop
    mapped: dict[int, Segment] = {}
    feed: Feed | None = None
    engine: DecodeEngine | None = None
    count: HeldCount | None = None
    try:
        if handover_from_service:
            count = HeldCount(fd=recv_handle(handover))
        dp_world, dp_rank, accum = spec.key
        config = FeedConfig.model_validate_json(spec.config_json)
        index = open_feed_index(spec.index, config)
        engine = DecodeEngine.build(index, config, with_pools=False)  # each pipeline makes its pools, as a Feed's
        asked = _HandoverAsked(handover, count) if count is not None else None
        shared = engine.shared(Plan.from_index(index, engine.config.plan), asked)
        feed = Feed(index, config, world_size=dp_world, rank=dp_rank, grad_accum=accum, shared=shared)
        feed.seek(FeedPosition.from_dict(start))
        threading.Thread(target=_answer_metrics, args=(metrics, feed), name="omnifeed-metrics", daemon=True).start()
        while True:
            request = work.recv()
            if request[0] == "seek":
                feed.seek(FeedPosition.from_dict(request[1]))
                if asked is not None:
                    asked.again()
                continue
            _, seq, handle, name, new, live = request
            segment = _mapped(work, mapped, handle, name, new)
            for gone in set(mapped) - set(live) - {handle}:
                mapped.pop(gone).close()  # the service closed it: its pages go with the last mapping
            reply = _produce(work, feed, mapped, seq, segment)
            try:
                work.send(reply)
            except (EOFError, OSError):
                return
            except Exception as exc:  # noqa: BLE001  the exception does not pickle
                work.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    except (EOFError, OSError, ProducerGone):
        return  # the service closed the pipe (or died)
    except Exception as exc:  # noqa: BLE001  the feed could not be built: the stream says why
        try:
            work.send(("error", exc))
            work.recv()  # the stream stops on the error and closes the pipe
        except Exception:  # noqa: BLE001
            pass
    finally:
        if feed is not None:
            feed.close()
        if engine is not None:
            engine.close()
        for segment in mapped.values():
            segment.close()
        if count is not None:
            count.close()


def _produce(work: Connection, feed: Feed, mapped: dict[int, Segment], seq: int, segment: Segment) -> tuple[Any, ...]:
    """The reply to a produce request: the batch's frame, the position after it and its record, or the error."""
    try:
        taken = feed.take()
        after = feed.position
        frame, _ = batch_frame(taken, after, seq, segment, lambda _old, needed: _grown(work, mapped, needed))
    except ProducerGone:
        raise
    except Exception as exc:  # noqa: BLE001  raised in the stream's producer thread
        return ("error", exc)
    return ("batch", frame, after.to_dict(), taken.record)


class _HandoverAsked:
    """The feed's hand-over (`Handover`): the service is asked, on the hand-over pipe, for a micro-batch's decoded
    samples (None: decode it; also when the pipe is gone), while its ledger holds some (``held``, shared memory: a job
    that never resized asks nothing) and for the first ``_ASKED`` micro-batches after the feed's start or a seek: what
    retired streams had prefetched lies right after where their clients left off, and a question per micro-batch for
    the rest of the epoch would cost a round trip each for nothing."""

    def __init__(self, conn: Connection, held: HeldCount) -> None:
        self._conn, self._held = conn, held
        self._lock = threading.Lock()  # the pipeline's threads ask one at a time
        self._left = _ASKED

    def again(self) -> None:
        """The feed moved (a seek): ask for its next micro-batches again."""
        with self._lock:
            self._left = _ASKED

    def __call__(self, micro_batch: MicroBatch) -> list[dict[str, Any]] | None:
        with self._lock:
            if self._left <= 0 or not self._held.get():
                return None
            self._left -= 1
            positions = np.asarray(micro_batch.positions, dtype=np.int64).tolist()
            try:
                self._conn.send((micro_batch.epoch, micro_batch.index, positions))
                held: list[dict[str, Any]] | None = self._conn.recv()
            except (EOFError, OSError):
                return None
        return held


def _answer_metrics(conn: Connection, feed: Feed) -> None:
    """Answer each request on the metrics pipe with the feed's metrics (None when they could not be read)."""
    while True:
        try:
            conn.recv()
        except (EOFError, OSError):
            return
        snapshot: dict[str, Any] | None
        try:
            snapshot = feed.metrics()
        except Exception:  # noqa: BLE001  a seek replaced the pipeline meanwhile: the service keeps the last ones
            snapshot = None
        try:
            conn.send(snapshot)
        except (EOFError, OSError):
            return


def _mapped(conn: Connection, mapped: dict[int, Segment], handle: int, name: list[int], new: bool) -> Segment:
    """The segment the stream names ``handle`` (``name``: slot, generation, size), mapped here; when ``new``, its
    descriptor is the next thing on the pipe."""
    if new:
        slot, generation, size = name
        mapped[handle] = Segment(slot, generation, size, fd=recv_handle(conn))
    return mapped[handle]


def _grown(conn: Connection, mapped: dict[int, Segment], needed: int) -> Segment:
    """Ask the stream for a segment of ``needed`` bytes (the batch did not fit its segment)."""
    try:
        conn.send(("grow", needed))
        _, handle, name, new = conn.recv()
        return _mapped(conn, mapped, handle, name, new)
    except (EOFError, OSError) as exc:
        raise ProducerGone() from exc
