"""`BatchLedger`: the service's account of batches outside any stream's ready list.

Two kinds, both kept across streams:

- **hand-over**: the decoded samples of micro-batches that retired streams (an old topology)
  had prefetched and no client took, keyed by (epoch, micro-batch); a new stream's pipeline
  takes one instead of reading and decoding it again (``handed_over`` counts them). At most
  ``limit`` are kept, the oldest dropped first; a new topology change clears them.
- **lent**: batches a stream dropped (every client of its group is past them) whose tensors a
  client still holds; their segments are recycled by their stream when the last holder
  releases them or leaves.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ..index import SampleIndex
from ..plan import MicroBatch
from ._arena import HeldCount
from ._stream import Ready, Stream

HANDOVER_LIMIT = 512  # micro-batches of retired streams kept for the new ones


class BatchLedger:
    """Micro-batches handed over from retired streams, and batches lent to clients after their stream dropped them."""

    def __init__(self, index: SampleIndex, limit: int = HANDOVER_LIMIT) -> None:
        self._index, self._limit = index, limit
        self._lock = threading.Lock()
        self._handover: OrderedDict[tuple[int, int], tuple[list[str], list[dict[str, Any]]]] = OrderedDict()
        self._lent: list[tuple[Ready, Stream]] = []
        self.handed_over = 0  # micro-batches a new stream took decoded from a retired one
        self.held = HeldCount()  # len(self._handover), for the producer processes (set under the lock)

    # -- hand-over --------------------------------------------------------------------------
    def hand_over(self, harvested: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> None:
        """Keep a retired stream's untaken batches (delivery record, decoded samples) for whichever stream deals
        them."""
        with self._lock:
            for record, samples in harvested:
                self._handover[(record["epoch"], record["micro_batch"])] = (record["keys"], samples)
            while len(self._handover) > self._limit:
                self._handover.popitem(last=False)
            self.held.set(len(self._handover))

    def take(self, micro_batch: MicroBatch) -> list[dict[str, Any]] | None:
        """The decoded samples of ``micro_batch`` if a retired stream had prefetched it (taken once; the keys must
        match: another plan's micro-batch of the same number is not it)."""
        return self.take_at(micro_batch.epoch, micro_batch.index, micro_batch.positions)

    def take_at(self, epoch: int, number: int, positions: np.ndarray | list[int]) -> list[dict[str, Any]] | None:
        """`take` of the micro-batch ``number`` of ``epoch`` made of the samples at ``positions`` (a producer process
        asks with these)."""
        with self._lock:
            if not self._handover:
                return None
            entry = self._handover.pop((epoch, number), None)
            self.held.set(len(self._handover))
        if entry is None or entry[0] != self._index.keys(positions):
            return None
        with self._lock:
            self.handed_over += 1
        return entry[1]

    def clear_handover(self) -> None:
        """Forget what earlier topology changes handed over (a new change began)."""
        with self._lock:
            self._handover.clear()
            self.held.set(0)

    def close(self) -> None:
        """Release the hand-over count's shared memory (the service stopped)."""
        with self._lock:
            self._handover.clear()
            self.held.close()

    # -- lent batches ----------------------------------------------------------------------
    def lend(self, ready: Ready, stream: Stream) -> None:
        """Keep track of a dropped batch that clients still hold (called holding the stream's lock: never calls it)."""
        with self._lock:
            self._lent.append((ready, stream))

    def release(self, token: str, seqs: set[int] | None) -> None:
        """The client ``token`` dropped these batches (None: it left, holding whatever it held); a batch no client
        holds any more is recycled by its stream."""
        with self._lock:
            if not self._lent:
                return
            lent = list(self._lent)
        done = [
            ready
            for ready, stream in lent
            if (seqs is None or ready.seq in seqs) and stream.return_lent(ready, token, left=seqs is None)
        ]
        if done:
            with self._lock:
                self._lent = [(r, s) for r, s in self._lent if r not in done]

    def give_back(self, client: int, seqs: set[int]) -> None:
        """The client gave back these batches unused (`Stream.give_back`), where its stream lent them."""
        with self._lock:
            lent = [(ready, stream) for ready, stream in self._lent if ready.seq in seqs]
        for ready, stream in lent:
            stream.give_back(client, seqs, [ready])

    def lent(self) -> int:
        """Batches lent out."""
        with self._lock:
            return len(self._lent)
